"""Verification step time of the SmolLM2 target vs batch shape → an ``sps-table`` profile.

    python scripts/bench_target.py --out out/profile_smollm2_cpu.json

R ∈ {1, 2, 4, 8, 16} requests × (1 + ℓ) ∈ {1, 2, 4, 8} verified tokens each, every request at a
128-token context, through :class:`dspark.targets.HFTarget` (padded batches: B = R · (1 + ℓ)).
Each shape is timed ``--repeats`` times after one warm-up, rolling the caches back to the context
after every step; the median is kept. The profile stores, per padded B, the median step time,
the largest one when several shapes share B. Prints a Markdown table (milliseconds).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dspark.cost_models import SPSProfile
from dspark.targets import load_target

REQUESTS = (1, 2, 4, 8, 16)
WIDTHS = (1, 2, 4, 8)  # 1 + ℓ tokens per request


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/profile_smollm2_cpu.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_target("smollm2-135m", dtype)
    g = torch.Generator().manual_seed(args.seed)
    ids = [f"r{i}" for i in range(max(REQUESTS))]
    # context + 1 prompt tokens: the cache holds `context`, the last one is the anchor
    prompts = [torch.randint(target.vocab_size, (args.context + 1,), generator=g) for _ in ids]
    for rid, p in zip(ids, prompts):
        target.prefill([rid], [p])
    keep = torch.full((max(REQUESTS),), args.context)

    times: dict[tuple[int, int], float] = {}
    for R in REQUESTS:
        for width in WIDTHS:
            tokens = torch.randint(target.vocab_size, (R, width), generator=g)
            lengths = torch.full((R,), width - 1)
            samples = []
            for step in range(1 + args.repeats):  # the first one warms up
                t0 = time.perf_counter()
                target.verify(ids[:R], tokens, lengths)
                elapsed = time.perf_counter() - t0
                target.rollback(ids[:R], keep[:R])
                if step:
                    samples.append(elapsed)
            times[R, width] = statistics.median(samples)
            print(f"R={R:2d} 1+ℓ={width}: {times[R, width] * 1e3:7.1f} ms", flush=True)

    by_b: dict[int, float] = {}
    for (R, width), seconds in times.items():
        b = R * width
        by_b[b] = max(by_b.get(b, 0.0), seconds)
    threads = torch.get_num_threads()
    profile = SPSProfile(
        device=f"{os.cpu_count()}-core {_cpu_name()}",
        model="SmolLM2-135M-Instruct",
        dtype=args.dtype,
        date=time.strftime("%Y-%m-%d"),
        accounting="padded",
        points=sorted(by_b.items()),
        threads=threads,
        notes=(
            f"scripts/bench_target.py: HFTarget.verify, R in {list(REQUESTS)} requests x (1 + l) in "
            f"{list(WIDTHS)} tokens, {args.context}-token context each, median of {args.repeats} "
            f"after one warm-up, torch {torch.__version__}, {threads} threads. B = R * (1 + l) "
            "padded tokens; where shapes share B the largest median is kept."
        ),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(out)

    print()
    print(f"Verification step time (ms), SmolLM2-135M {args.dtype}, {args.context}-token context, "
          f"{threads} threads, median of {args.repeats}:")
    print()
    print("| R \\ 1+ℓ | " + " | ".join(str(w) for w in WIDTHS) + " |")
    print("|---|" + "---|" * len(WIDTHS))
    for R in REQUESTS:
        print(f"| {R} | " + " | ".join(f"{times[R, w] * 1e3:.1f}" for w in WIDTHS) + " |")
    print()
    print("| B (padded) | step ms |")
    print("|---|---|")
    for b, seconds in sorted(by_b.items()):
        print(f"| {b} | {seconds * 1e3:.1f} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
