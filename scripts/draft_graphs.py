"""Time a drafter's graphs one by one, eager and compiled, on the inputs of a real round.

    python scripts/draft_graphs.py --drafter dspark-5l-xl:vocab=14086 --dtype bfloat16 [--compile] [--gemm onednn]

One short generation records the inputs each graph (context, backbone, head; Eagle3's fuse,
context, step) received in its last round; each graph is then timed alone on them (median of
``--repeats`` calls), eager and — with ``--compile`` — through torch.compile with weight freezing
and the GEMM kernels the compiled draft runner gives that call (``--gemm runner``: the template for
one request's few rows, :class:`dspark.fast.compile.GraphRows`) or oneDNN for every product
(``--gemm onednn``). Prints one line per graph with its input shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dspark
from dspark.drafters.loop import GraphCalls, TorchRunner
from dspark.fast.compile import GraphRows, compile_step
from dspark.types import SamplingParams


def median_ms(fn, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn(**inputs)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(**inputs)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="dspark-5l-xl")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt", default="Explain the water cycle briefly.")
    p.add_argument("--compile", action="store_true", help="time the compiled graphs too")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gemm", choices=("runner", "onednn"), default="runner",
                   help="compiled graphs' products: as the compiled runner chooses, or oneDNN for all")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = dspark.load_target(args.target, getattr(torch, args.dtype))
    drafter = dspark.from_pretrained(args.drafter, target=target)  # NAME or NAME:vocab=K
    engine = dspark.Engine(target, drafter, scheduler="sps-greedy")
    with GraphCalls(drafter.loop.runner, keep_inputs=True) as calls:  # the last round's inputs
        engine.generate([args.prompt], SamplingParams.greedy(), max_new_tokens=16, progress=False)
    seen = calls.inputs
    specs = {g.name: g for g in drafter.graph_specs(drafter, live=True)}
    device = next(drafter.parameters()).device
    for name, inputs in seen.items():
        shapes = {k: tuple(v.shape) for k, v in inputs.items()}
        line = f"{name:9s} eager {median_ms(specs[name].module, inputs, args.repeats):7.2f} ms"
        if args.compile and device.type == "cpu" and name in TorchRunner.EAGER_ON_CPU:
            line += "   (the compiled runner keeps it eager on a CPU)"
        elif args.compile:
            rows = GraphRows(specs[name], drafter.dtype) if args.gemm == "runner" else None
            compiled = compile_step(specs[name].module, device, graph_options=rows.options if rows else None)
            inputs = rows.mark(inputs) if rows else inputs
            t0 = time.perf_counter()
            with torch.inference_mode():
                compiled(**inputs)
            line += (f"   compiled ({args.gemm}) {median_ms(compiled, inputs, args.repeats):7.2f} ms "
                     f"({time.perf_counter() - t0:.0f} s to compile)")
        print(f"{line}   {shapes}", flush=True)


if __name__ == "__main__":
    main()
