"""Render the README's results table from docs/reports/results.json.

    python scripts/results_table.py           # rewrite README.md between the results markers
    python scripts/results_table.py --check   # exit 1 if README.md differs from the rendering

One row per measured figure: date, machine kind, command and figure, the figure linked to the
report that holds the full command and the machine's description. Add a row to results.json (and
its report under docs/reports/), then run this script; tests/test_docs.py checks the README.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "reports" / "results.json"
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def render(results: Path = RESULTS) -> str:
    """The table, markers included (README-relative links)."""
    rows = json.loads(results.read_text(encoding="utf-8"))["rows"]
    lines = [START, "| date | machine | command | figure |", "|---|---|---|---|"]
    for row in rows:
        figure = row["figure"]
        if row.get("report"):
            figure += f" ([report]({row['report']}))"
        lines.append(f"| {row['date']} | {row['machine']} | `{row['command']}` | {figure} |")
    lines.append(END)
    return "\n".join(lines)


def current(readme: Path = README) -> str:
    """The README's table as it stands, markers included."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def write(readme: Path = README) -> bool:
    """Rewrite the README's table; True if it changed."""
    text = readme.read_text(encoding="utf-8")
    old = current(readme)
    new = text.replace(old, render(), 1)
    readme.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if README.md is out of date")
    args = ap.parse_args(argv)
    if args.check:
        ok = current() == render()
        print("README.md results table is up to date" if ok else
              "README.md results table is out of date: run python scripts/results_table.py")
        return 0 if ok else 1
    print("README.md results table " + ("rewritten" if write() else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
