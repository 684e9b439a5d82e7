"""Sequential-head latency: median wall time of one ``step`` call, printed as a Markdown table.

    python scripts/bench_heads.py [--threads N] [--repeats 200] [--device cpu|cuda]

SmolLM2 sizes by default (V = 49152, d = 576, r = 256), R = 1, 8, 64 requests, fp32, W_up
randomised (a zero W_up costs the same). One step is run γ−1 times per drafting round; compare
with the backbone forward and the target's verification step. Timings are noisy on shared
machines: medians of many calls.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from dspark.heads import HEAD_KINDS, build_head


def median_us(fn, repeats: int, sync) -> float:
    for _ in range(10):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)

    rows = {}
    for kind in HEAD_KINDS:
        head = build_head(kind, args.vocab, args.hidden, args.rank).to(device).eval()
        with torch.no_grad():
            head.w_up.weight.normal_(std=0.02)
        rows[kind] = (head.num_parameters(), [])
        for R in args.requests:
            prev = torch.randint(0, args.vocab, (R,), generator=g).to(device)  # [R]
            hidden = torch.randn(R, args.hidden, generator=g).to(device)  # [R, d]
            base = torch.randn(R, args.vocab, generator=g).to(device)  # [R, V]
            state = torch.zeros(R, args.rank, device=device) if kind == "rnn" else None
            with torch.inference_mode():
                us = median_us(lambda h=head, p=prev, x=hidden, u=base, s=state: h.step(p, x, u, s),
                               args.repeats, sync)
            rows[kind][1].append(us)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"One `step`, median µs — V={args.vocab}, d={args.hidden}, r={args.rank}, fp32, "
          f"torch {torch.__version__}, {where}\n")
    print("| head | params | " + " | ".join(f"R={R}" for R in args.requests) + " |")
    print("|---|---:|" + "---:|" * len(args.requests))
    for kind, (params, times) in rows.items():
        print(f"| {kind} | {params:,} | " + " | ".join(f"{t:,.0f}" for t in times) + " |")


if __name__ == "__main__":
    main()
