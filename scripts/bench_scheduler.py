"""Scheduler latency benchmark: median wall time of one schedule() call.

    python scripts/bench_scheduler.py --out docs/reports/figures

R = 1..512 requests × γ = 7 and 16, for sps-greedy (packed and padded accounting) and the
cheap schedulers, single-threaded torch. Writes scheduler_bench.json, scheduler_bench.png and
prints a Markdown table. Timings are noisy on shared machines: medians of many calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import dspark

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def median_us(fn, repeats: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/reports/figures")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    packed = dspark.get_cost_model("sps-table", accounting="packed")
    padded = dspark.get_cost_model("sps-table", accounting="padded")
    cases = {
        "sps-greedy (packed)": (dspark.get_scheduler("sps-greedy"), packed),
        "sps-greedy (padded)": (dspark.get_scheduler("sps-greedy"), padded),
        "threshold": (dspark.get_scheduler("threshold", threshold=0.5), packed),
        "fixed k=1": (dspark.get_scheduler("fixed", k=1), packed),
    }
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": 1, "date": time.strftime("%Y-%m-%d"), "median_us": {}}
    for gamma in (7, 16):
        for name, (sched, cost) in cases.items():
            key = f"{name}, γ={gamma}"
            results["median_us"][key] = {}
            for R in SIZES:
                c = 0.3 + 0.7 * torch.rand(R, gamma, generator=g)
                us = median_us(lambda s=sched, c=c, m=cost: s.schedule(c, cost_model=m), args.repeats)
                results["median_us"][key][R] = us
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduler_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "scheduler_bench.png")
    print(_markdown(results))


def _markdown(results: dict) -> str:
    keys = list(results["median_us"])
    lines = ["| scheduler | " + " | ".join(f"R={R}" for R in SIZES) + " |",
             "|---|" + "---|" * len(SIZES)]
    for k in keys:
        row = results["median_us"][k]
        lines.append(f"| {k} | " + " | ".join(f"{row[R]:.0f}" for R in SIZES) + " |")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, row in results["median_us"].items():
        ax.plot(SIZES, [row[R] for R in SIZES], marker="o", ls="-" if "γ=7" in k else "--", label=k)
    ax.axhline(100, color="grey", lw=0.8, ls=":")
    ax.annotate("100 µs target (R=256, γ=7)", (1, 104), fontsize=8, color="grey")
    ax.set(xscale="log", yscale="log", xlabel="requests R", ylabel="median µs per schedule()",
           title="Scheduler latency (1 thread, CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
