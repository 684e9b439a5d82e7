"""The README main job's speed-up per kind of CPU, from ``dspark demo`` outputs (one folder per machine).

    python scripts/speed_by_cpu.py out/demo-avx512bf16 out/demo-avx2 --png docs/reports/figures/speed_by_cpu.png

Prints a Markdown table (machine, dtype chosen and why, the verification profile's shape, the
speed-up over the best plain decode, τ, drafted rounds) and draws a bar chart of the speed-ups.
Every number comes from the ``demo.json`` files; each row carries the command that produced it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(folders: list[Path]) -> list[dict]:
    out = []
    for folder in folders:
        d = json.loads((Path(folder) / "demo.json").read_text())
        sp, ch, m = d["speed"], d["dtype_choice"], d["machine"]
        prof = {int(q): s for q, s in ch["profile_step_seconds"].items()}
        gate = sp["gate_rounds"]
        out.append({
            "kind": m["kind"], "cpu": f"{m['cores']}-core {m['cpu']}", "threads": m["threads"],
            "flags": " ".join(m["flags"]), "dtype": ch["dtype"],
            "plain_ms": {k: 1e3 * v for k, v in ch["plain_step_seconds"].items()},
            "t1_ms": 1e3 * prof[1], "tmax_ms": 1e3 * prof[max(prof)], "qmax": max(prof),
            "speedup": sp["speedup_vs_best_plain"], "baseline": sp["baseline"], "tau": sp["mean_tau"],
            "drafted": 1 - gate["skipped"] / max(gate["rounds"], 1),
            # the ISA caps are environment variables: they belong to the command
            "command": " ".join([*m.get("isa_caps", []), d["command"]]),
        })
    return out


def markdown(table: list[dict]) -> list[str]:
    lines = ["| kind of CPU | machine | plain step fp32 / bf16 | dtype chosen | verify 1 → γ+1 tokens | "
             "speed-up over best plain | τ | rounds drafted |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        p = r["plain_ms"]
        lines.append(
            f"| {r['kind']} | {r['cpu']}, {r['threads']} threads ({r['flags']}) | "
            f"{p.get('float32', float('nan')):.1f} / {p.get('bfloat16', float('nan')):.1f} ms | {r['dtype']} | "
            f"{r['t1_ms']:.1f} → {r['tmax_ms']:.1f} ms | **{r['speedup']:.2f}×** ({r['baseline']}) | "
            f"{r['tau']:.2f} | {100 * r['drafted']:.0f} % |")
    lines += ["", "Commands:", ""] + [f"* {r['kind']}: `{r['command']}`" for r in table]
    return lines


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.8 * len(table)))
    labels = [f"{r['kind'].split(' — ')[0]}\n{r['dtype']}" for r in table]
    ax.barh(labels, [r["speedup"] for r in table], color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in table])
    ax.axvline(1.0, color="k", lw=1, ls="--")
    for i, r in enumerate(table):
        ax.text(r["speedup"] + 0.01, i, f"{r['speedup']:.2f}×", va="center")
    ax.set_xlabel("wall-clock speed-up over the best plain decode (concurrency 1)")
    ax.set_xlim(0, max(1.2, max(r["speedup"] for r in table) * 1.2))
    ax.set_title("dspark demo by kind of CPU (SmolLM2-135M)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demos", nargs="+", type=Path, help="dspark demo output folders (each with demo.json)")
    ap.add_argument("--png", type=Path, help="bar chart of the speed-ups")
    a = ap.parse_args()
    table = rows(a.demos)
    print("\n".join(markdown(table)))
    if a.png:
        plot(table, a.png)


if __name__ == "__main__":
    main()
