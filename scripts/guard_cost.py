"""What dynamo's guards cost a compiled call: dspark's compiled graphs (no guard on their frozen
weights, ``dspark.fast.compile.drop_weight_guards``) against the same graphs under torch's default
guards, side by side in one process.

    python scripts/guard_cost.py --out RUNS/guards

Graphs: the bf16 target step of one request and one token over a 160-token past (the plain-decoding
step), and the draft graphs of the shipped drafter's measured vocabulary cut (``context`` over two new
positions, ``backbone``) on the inputs of a real round. Each graph is compiled twice — ``dspark``
(``compile_step``) and ``default`` (the same module through ``torch.compile`` with every guard) —
each on a code object of its own (``own_forward``), so neither reuses the other's graphs. The
products run on inductor's default kernels in both (the guards do not depend on them, and the
autotuned one-token graph would take minutes more to compile). Calls alternate between the two, 5 ×
40 of each after a warm-up; a call's time is the median of the 5 means, and dynamo's own share is
the profiler's "TorchDynamo Cache Lookup" per call. Writes ``guard_cost.json`` and ``guard_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("guard_cost")


def _time_pair(calls: dict[str, object], rounds: int = 5, n: int = 40) -> dict[str, dict[str, float]]:
    """Alternate the callables; → {name: {ms (median of the rounds' means), lookup_us}}."""
    from torch.profiler import ProfilerActivity, profile

    means: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(10):
                fn()
        for _ in range(rounds):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                means[name].append((time.perf_counter() - t0) / n * 1e3)
        out = {}
        for name, fn in calls.items():
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(20):
                    fn()
            look = next((e for e in p.key_averages() if e.key == "TorchDynamo Cache Lookup"), None)
            out[name] = {"ms": statistics.median(means[name]),
                         "lookup_us": look.cpu_time_total / look.count if look else float("nan")}
    return out


def _default_guards(module: torch.nn.Module):
    from dspark.fast.compile import CPU_OPTIONS, _Patched, own_forward

    return _Patched(torch.compile(own_forward(module), dynamic=True, fullgraph=True), CPU_OPTIONS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    import dspark
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
    from dspark.drafters.loop import GraphCalls
    from dspark.drafters.vocab_cut import raceable_cut
    from dspark.engine import Engine
    from dspark.fast.compile import compile_step
    from dspark.fast.llama import LlamaStep
    from dspark.profiling import device_name
    from dspark.types import SamplingParams

    cpu = torch.device("cpu")
    target = dspark.load_target("smollm2-135m", torch.bfloat16)
    step = LlamaStep(target.model)
    L, H_kv, d = len(step.layers), step.kv_heads, step.head_dim
    past = torch.zeros(L, 2, 1, H_kv, 256, d, dtype=torch.bfloat16)[:, :, :, :, :192]
    step_args = (torch.tensor([[42]]), torch.tensor([[160]]), past, torch.arange(192)[None] < 160, (), True)
    rows = []
    graphs = {"target step (q = 1)": (step, lambda fn: (lambda: fn(*step_args)))}

    # the draft graphs on the inputs of a real round, as scripts/draft_graphs.py records them
    cut, _ = raceable_cut(resolve_checkpoint(DEFAULT_DRAFTER))
    drafter = dspark.from_pretrained(DEFAULT_DRAFTER, target=target, draft_vocab=cut.draft_vocab if cut else None)
    with GraphCalls(drafter.loop.runner, keep_inputs=True) as calls:
        Engine(target, drafter, scheduler=dspark.get_scheduler("fixed", k=drafter.gamma), cost_model=None).generate(
            ["Explain the water cycle briefly."], SamplingParams.greedy(), max_new_tokens=16, progress=False)
    seen = calls.inputs
    modules = {g.name: g.module for g in drafter.graph_specs(drafter, live=True)}
    for name in ("context", "backbone"):
        graphs[f"draft {name}"] = (modules[name], lambda fn, x=seen[name]: (lambda: fn(**x)))

    for label, (module, caller) in graphs.items():
        t0 = time.perf_counter()
        calls = {"dspark": caller(compile_step(module, cpu)), "default": caller(_default_guards(module))}
        with torch.inference_mode():
            for fn in calls.values():
                fn()
        compile_s = time.perf_counter() - t0
        res = _time_pair(calls)
        row = {"graph": label, "compile_s": compile_s, **{f"{k}_{m}": v[m] for k, v in res.items() for m in v}}
        rows.append(row)
        log.info("%s: dspark %.3f ms (lookup %.0f us), default guards %.3f ms (lookup %.0f us)", label,
                 row["dspark_ms"], row["dspark_lookup_us"], row["default_ms"], row["default_lookup_us"])
    result = {"machine": device_name(None), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": rows}
    (args.out / "guard_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{result['machine']}, torch {result['torch']}, {result['threads']} threads: one call of each compiled "
             "graph, dspark's guards (none on the frozen weights) against torch's default guards", "",
             "| graph | dspark ms | default ms | saved ms | dynamo lookup, dspark µs | default µs |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['graph']} | {r['dspark_ms']:.3f} | {r['default_ms']:.3f} | {r['default_ms'] - r['dspark_ms']:.3f} "
              f"| {r['dspark_lookup_us']:.0f} | {r['default_lookup_us']:.0f} |" for r in rows]
    (args.out / "guard_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
