"""Table and figure of several `scripts/experiments/lockstep_ab.py` runs (one per concurrency level).

    python scripts/experiments/lockstep_report.py OUT RUN.json [RUN.json ...]

Writes OUT.md (per level: each entry's tok/s ratio to the first entry, its ratio to the best
other entry, the same two at full concurrency only (rounds with c requests live: the closed loop's
tail, where requests finish in a different order for each entry, left out), drafted rounds, and
the mean draft / target / other milliseconds of a round) and OUT.png (the ratios against concurrency).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, runs = Path(argv[0]), sorted((json.loads(Path(p).read_text()) for p in argv[1:]), key=lambda r: r["concurrency"])
    names = list(dict.fromkeys(n for r in runs for n in r["rows"]))  # every entry of any run, in order
    base = names[0]
    md = [f"# Lockstep: {', '.join(names)} against {base}", "",
          "Each level one run: every engine steps one round in turn (the order rotated each turn), the same "
          "closed loop of requests, bf16. Ratio: tok/s against the first entry; vs best other: against the "
          "fastest of the other entries; *at c*: the same over the rounds with all c requests live (the "
          "tail, where fewer are left, differs between entries). Round ms split into draft (drafting, confidence, scheduling), "
          "target (the verification step) and the rest (sampling, bookkeeping).", "",
          "| c | requests | entry | tok/s | ratio | vs best other | ratio at c | vs best other at c | drafted / rounds "
          "| draft ms | target ms | rest ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = r["rows"]
        for n in rows:  # a run may leave an entry out (e.g. fixed:k=7 at c = 64)
            x = rows[n]
            best_other = max(rows[m]["tok_s"] for m in rows if m != n)
            rest = x["round_ms"] - x["draft_ms"] - x["target_ms"]
            if "full_tok_s" in x:  # runs recorded before the steady-state columns have none
                full_other = max(rows[m]["full_tok_s"] for m in rows if m != n)
                at_c = f"{x['full_ratio']:.3f} | {x['full_tok_s'] / max(full_other, 1e-12):.3f}"
            else:
                at_c = "– | –"
            md.append(f"| {r['concurrency']} | {r['requests']} | {n} | {x['tok_s']:.1f} | {x['ratio']:.3f} | "
                      f"{x['tok_s'] / best_other:.3f} | {at_c} | {x['drafted']} / {x['rounds']} | {x['draft_ms']:.2f} | "
                      f"{x['target_ms']:.2f} | {rest:.2f} |")
    md += ["", "Commands:", ""] + [f"    {r['command']}" for r in runs] + [""]
    out.with_suffix(".md").write_text("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for n in names:
        have = [r for r in runs if n in r["rows"]]
        ax.plot([r["concurrency"] for r in have], [r["rows"][n]["ratio"] for r in have], marker="o", label=n)
    ax.axhline(0.99, color="grey", lw=0.8, ls="--", label="0.99 (issue 14)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel(f"tok/s ÷ {base}, same run, lockstep")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
