"""The test suite's durations by tier and by file, from pytest's JUnit XML (``make test`` writes it).

    python scripts/test_durations.py out/tests/junit.xml --out docs/reports/DATE-test-durations.md \
        --machine "2-core AMD EPYC (AVX2)"

Tiers are the markers: ``slow`` (the real SmolLM2 target, model-heavy) and the unit tier (the rest;
``make test-fast``). Times are summed per test as pytest measured them (setup + call + teardown),
so with ``-n 2`` the wall-clock time is about half the sum.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def _rows(junit: Path) -> list[dict]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        rows.append({"file": case.get("classname", "").removeprefix("tests.").split(".")[0] or "?",
                     "name": case.get("name", ""), "seconds": float(case.get("time", 0) or 0),
                     "outcome": outcome, "slow": props.get("tier") == "slow"})
    return rows


def render(rows: list[dict], command: str, machine: str) -> str:
    by_tier = collections.defaultdict(lambda: [0, 0.0])
    by_file = collections.defaultdict(lambda: [0, 0.0, False])
    for r in rows:
        tier = "slow (real target)" if r["slow"] else "unit"
        by_tier[tier][0] += 1
        by_tier[tier][1] += r["seconds"]
        f = by_file[r["file"]]
        f[0] += 1
        f[1] += r["seconds"]
        f[2] = f[2] or r["slow"]
    outcomes = collections.Counter(r["outcome"] for r in rows)
    lines = [f"# Test durations — {machine}", "", f"Command: `{command}`", "",
             "Outcomes: " + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) + ".", "",
             "| tier | tests | summed seconds |", "|---|---|---|"]
    lines += [f"| {t} | {n} | {s:,.0f} |" for t, (n, s) in sorted(by_tier.items())]
    lines += ["", "| file | tests | summed seconds | tier |", "|---|---|---|---|"]
    for name, (n, s, slow) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {s:,.1f} | {'slow' if slow else 'unit'} |")
    lines += ["", "The 20 slowest tests:", "", "| test | seconds |", "|---|---|"]
    for r in sorted(rows, key=lambda r: -r["seconds"])[:20]:
        lines.append(f"| {r['file']}::{r['name']} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--machine", required=True, help="the machine, named in the report")
    ap.add_argument("--command", default="make test")
    args = ap.parse_args()
    args.out.write_text(render(_rows(args.junit), args.command, args.machine), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
