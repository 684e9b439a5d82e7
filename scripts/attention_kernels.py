"""Attention of one decoder layer, spelled out (product, mask, fp32 softmax, product) against
``torch.nn.functional.scaled_dot_product_attention``, at the target step's shapes.

    python scripts/attention_kernels.py --threads 2

SmolLM2-135M's grouping (3 K/V heads, 3 query heads each, head dim 64): the query heads of one K/V
head are stacked as g·q rows, as :class:`dspark.fast.llama.LlamaStep` lays them out. Prints the median
milliseconds a call for q = 1, 8, 64 query tokens over ``--context`` past tokens, fp32 and bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def spelled_out(qg, k, v, allowed, scale):
    """[R, H_kv, g·q, d] queries over [R, H_kv, T + q, d] keys / values, a [R, 1, g·q, T + q] mask."""
    scores = (qg @ k.transpose(-1, -2) * scale).float().masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1).to(qg.dtype) @ v


def sdpa(qg, k, v, allowed, scale):
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed, scale=scale)


def _ms(fn, *inputs, repeats: int = 300) -> float:
    for _ in range(20):
        fn(*inputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=160)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kv_heads, group, d, T = 3, 3, 64, args.context
    print("| dtype | q | spelled out ms | sdpa ms |\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for q in (1, 8, 64):
            g = torch.Generator().manual_seed(0)
            qg = torch.randn(1, kv_heads, group * q, d, generator=g).to(dtype)
            k, v = (torch.randn(1, kv_heads, T + q, d, generator=g).to(dtype) for _ in range(2))
            inputs = (qg, k, v, torch.ones(1, 1, group * q, T + q, dtype=torch.bool), d ** -0.5)
            torch.testing.assert_close(sdpa(*inputs).float(), spelled_out(*inputs).float(), atol=2e-2, rtol=2e-2)
            print(f"| {str(dtype).removeprefix('torch.')} | {q} | {_ms(spelled_out, *inputs):.3f} | "
                  f"{_ms(sdpa, *inputs):.3f} |")


if __name__ == "__main__":
    main()
