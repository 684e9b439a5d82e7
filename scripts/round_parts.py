"""Where a round's time goes at one request, as the demo runs it: the compiled bf16 target, the
shipped drafter's measured vocabulary cut on the compiled draft runner, greedy.

    python scripts/round_parts.py --out RUNS/round_parts [--lengths 0,3,7] [--tokens 64] [--repeats 2]

Each verify length k (0: plain decoding, no drafter; k > 0: the ``fixed`` scheduler, every round
drafting γ and verifying k drafts) decodes the same three prompts (code, explanation, arithmetic)
``--tokens`` tokens each, after one warm-up pass that compiles every graph. Per round, from the
engine's own timings: the target's step (``target``, prefills included), the draft (``draft``:
the drafter's round, the confidence and the schedule), the sequential head's steps and the whole
round; per draft graph call, the median time of each graph (``context``, ``backbone``, ``head``)
and its calls per round. The lengths run in turn, ``--repeats`` times; the table keeps the last
pass (the JSON keeps all). Writes ``round_parts.json`` and ``round_parts.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("round_parts")

PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
           "Explain the water cycle briefly.",
           "Solve: 12 * (3 + 4) - 5 = ?")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", default="0,3,7", help="verify lengths k (0: plain decoding)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lengths = [int(k) for k in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    import dspark
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
    from dspark.drafters.loop import GraphCalls
    from dspark.drafters.vocab_cut import raceable_cut
    from dspark.engine import Engine
    from dspark.fast.drafter import use_draft_runner
    from dspark.profiling import device_name
    from dspark.types import SamplingParams

    target = dspark.load_target("smollm2-135m", torch.bfloat16, path="compiled")
    cut, _ = raceable_cut(resolve_checkpoint(DEFAULT_DRAFTER))
    drafter = dspark.from_pretrained(DEFAULT_DRAFTER, target=target, draft_vocab=cut.draft_vocab if cut else None)
    runner_name = use_draft_runner(drafter, "compiled")
    if max(lengths) > drafter.gamma:
        p.error(f"--lengths: at most γ = {drafter.gamma}")
    def one_pass(k: int, tokens: int) -> dict:
        engine = (Engine(target, drafter, scheduler=dspark.get_scheduler("fixed", k=k), cost_model=None) if k
                  else Engine(target, None, cost_model=None))
        with GraphCalls(drafter.loop.runner) as calls:
            for prompt in PROMPTS:
                engine.generate([prompt], SamplingParams.greedy(), max_new_tokens=tokens, progress=False)
        n = engine.rounds
        return {"k": k, "rounds": n, **{f"{key}_ms": 1e3 * v / n for key, v in engine.timings.items()},
                "graphs": {g: {"median_ms": 1e3 * statistics.median(v), "per_round": len(v) / n}
                           for g, v in calls.seconds.items()}}

    t0 = time.perf_counter()
    for k in lengths:  # compiles every graph these lengths meet
        one_pass(k, 24)
    log.info("warm-up (compiling) took %.0f s", time.perf_counter() - t0)
    passes = []
    for _ in range(args.repeats):
        for k in lengths:
            passes.append(one_pass(k, args.tokens))
            log.info("k = %d: %s", k, passes[-1])
    result = {"machine": device_name(None), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "target_path": target.path, "draft_runner": runner_name,
              "draft_vocab": cut.draft_vocab if cut else None, "tokens": args.tokens, "passes": passes}
    (args.out / "round_parts.json").write_text(json.dumps(result, indent=2) + "\n")
    last = passes[-len(lengths):]
    graphs = sorted({g for r in last for g in r["graphs"]})
    lines = [f"{result['machine']}, torch {result['torch']}, {result['threads']} threads: one request, bf16 "
             f"{result['target_path']} target, drafter on the {runner_name} runner "
             f"(vocabulary {result['draft_vocab'] or 'full'}), greedy; ms per round", "",
             "| k | rounds | target | draft | sequential head | round | " + " | ".join(graphs) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(graphs)]
    for r in last:
        cells = [f"{r['graphs'][g]['median_ms']:.2f} × {r['graphs'][g]['per_round']:.0f}" if g in r["graphs"] else ""
                 for g in graphs]
        lines.append(f"| {r['k']} | {r['rounds']} | {r['target_ms']:.2f} | {r['draft_ms']:.2f} | "
                     f"{r['sequential_head_ms']:.2f} | {r['round_ms']:.2f} | " + " | ".join(cells) + " |")
    (args.out / "round_parts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
