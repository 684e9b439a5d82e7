"""This checkout's draft layers against another revision's, side by side in one process: the
compiled ``backbone`` and ``context`` graphs of two copies of the shipped drafter (its measured
vocabulary cut), one copy's layers switched to the class in ``--base``'s ``dspark/drafters/layers.py``.

    python scripts/draft_layers_ab.py --base 3f1fb84 --out RUNS/layers_ab [--rounds 6] [--calls 60]

One greedy generation records the inputs each graph received in its last round; both copies'
graphs are compiled as the compiled draft runner compiles them, checked against each other (the
largest difference of each output), then timed on those inputs in turn: ``--rounds`` rounds of
``--calls`` calls of each graph (median per round, then the median of the rounds). Writes
``draft_layers_ab.json`` and ``draft_layers_ab.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

log = logging.getLogger("draft_layers_ab")

GRAPHS = ("backbone", "context")


def layers_module(rev: str) -> types.ModuleType:
    """``dspark.drafters.layers`` as it was at ``rev``, importable (dynamo imports a traced
    function's module by name) as ``dspark_layers_<rev>``."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:src/dspark/drafters/layers.py"],
                            capture_output=True, text=True, check=True).stdout
    name = f"dspark_layers_{rev}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"{rev}:src/dspark/drafters/layers.py", "exec"), module.__dict__)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the git revision whose draft layers are compared")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    from draft_graphs import median_ms  # a sibling script: the graphs timed one by one

    import dspark
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
    from dspark.drafters.loop import GraphCalls
    from dspark.drafters.vocab_cut import raceable_cut
    from dspark.fast.compile import compile_step
    from dspark.profiling import device_name
    from dspark.types import SamplingParams

    base = layers_module(args.base)
    target = dspark.load_target("smollm2-135m", torch.bfloat16)
    cut, _ = raceable_cut(resolve_checkpoint(DEFAULT_DRAFTER))
    copies = {name: dspark.from_pretrained(DEFAULT_DRAFTER, target=target, draft_vocab=cut.draft_vocab if cut else None)
              for name in ("this checkout", args.base)}
    for layer in copies[args.base].layers:
        layer.__class__ = base.DraftLayer
    engine = dspark.Engine(target, copies["this checkout"], scheduler=dspark.get_scheduler("fixed", k=3), cost_model=None)
    with GraphCalls(copies["this checkout"].loop.runner, keep_inputs=True) as calls:
        engine.generate(["Explain the water cycle briefly."], SamplingParams.greedy(), max_new_tokens=60, progress=False)
    device = torch.device("cpu")
    result = {"machine": device_name(None), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "base": args.base, "inputs": {g: {k: list(v.shape) for k, v in calls.inputs[g].items()} for g in GRAPHS},
              "max_abs_difference": {}, "rounds_ms": {}}
    with torch.inference_mode():
        fns = {}
        for name, drafter in copies.items():
            graphs = {g.name: g.module for g in drafter.graph_specs(drafter, live=True)}
            for g in GRAPHS:
                fns[name, g] = compile_step(graphs[g], device)
                fns[name, g](**calls.inputs[g])  # compiles
        for g in GRAPHS:
            a, b = (fns[name, g](**calls.inputs[g]) for name in copies)
            result["max_abs_difference"][g] = [float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)]
        for _ in range(args.rounds):
            for (name, g), fn in fns.items():
                result["rounds_ms"].setdefault(f"{g} | {name}", []).append(median_ms(fn, calls.inputs[g], args.calls))
    (args.out / "draft_layers_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{result['machine']}, torch {result['torch']}, {result['threads']} threads: the compiled draft graphs "
             f"on one real round's inputs, median of {args.rounds} rounds × {args.calls} calls", "",
             "| graph | draft layers | ms | per round |", "|---|---|---|---|"]
    for key, values in result["rounds_ms"].items():
        g, name = key.split(" | ")
        lines.append(f"| {g} | {name} | {statistics.median(values):.3f} | {', '.join(f'{v:.2f}' for v in values)} |")
    lines += ["", "Largest difference of each output between the two: "
              + "; ".join(f"{g} {v}" for g, v in result["max_abs_difference"].items())]
    (args.out / "draft_layers_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
