"""The training curve of a drafter trained in stages (each stage `--init-from` the last), on one step axis.

    python scripts/chain_curve.py RUNS/dspark-5l RUNS/dspark-5l-long \
        RUNS/dspark-5l-xl --out docs/reports/figures/dspark-5l-chain.png

Each RUN folder holds the `log.jsonl` of `dspark train` (one record per step: loss, analytic τ on the
step's own teacher-forced batch). The per-step values are noisy (8 sequences × 8 anchors a step), so
the figure draws a 200-step running mean over the raw points and prints each stage's mean over its
last 500 steps and its wall-clock (`train.json`'s seconds_total).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from paper_findings import load_log, moving_mean  # noqa: E402  (a sibling script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders, in training order")
    ap.add_argument("--out", type=Path, required=True, help="PNG path")
    ap.add_argument("--window", type=int, default=200, help="running-mean window in steps")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    offset, seconds = 0, 0.0
    for run in args.runs:
        log = load_log(run / "log.jsonl")
        steps = np.array([r["step"] for r in log]) + offset
        meta = json.loads((run / "train.json").read_text())
        seconds += float(meta.get("seconds_total", 0.0))
        for ax, key in zip(axes, ("loss", "tau")):
            y = np.array([r[key] for r in log], dtype=float)
            (raw,) = ax.plot(steps, y, lw=0.3, alpha=0.25)
            if y.size >= args.window:  # full windows only: no warm-up at the start of a stage
                smooth = moving_mean(list(y), args.window)[args.window - 1:]
                ax.plot(steps[args.window - 1:], smooth, lw=1.8, color=raw.get_color(), label=run.name)
        tail = [r for r in log if r["step"] >= log[-1]["step"] - 499]
        print(f"{run.name}: steps {offset}..{offset + len(log) - 1}, last-500 mean loss "
              f"{np.mean([r['loss'] for r in tail]):.3f}, τ {np.mean([r['tau'] for r in tail]):.3f}; "
              f"cumulative training {seconds / 3600:.2f} h")
        offset += len(log)
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("analytic τ (teacher-forced, training batch)")
    for ax in axes:
        ax.set_xlabel("step (cumulative)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
