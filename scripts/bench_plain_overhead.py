"""Plain-decoding engine overhead: (round − target forward) / round, R = 1, 4, 16 (docs/serving-and-benchmarks.md).

    python scripts/bench_plain_overhead.py
"""
import torch

import dspark
from dspark.engine import Engine

torch.set_num_threads(1)
t = dspark.load_target("smollm2-135m")
prompts = [f"Write a long story number {i} about a lighthouse keeper." for i in range(16)]
for R in (1, 4, 16):
    res = []
    for _ in range(3):
        e = Engine(t, None, scheduler="full", cost_model=None)
        e.generate(prompts[:R], max_new_tokens=6, progress=False)
        tm = e.timings
        res.append(100 * (tm["round"] - tm["target"]) / tm["round"])
    res.sort()
    print(R, f"{res[1]:.1f}%")
