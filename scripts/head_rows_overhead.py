"""The sequential head's share of a draft round with its correction rows kept, and without.

    python scripts/head_rows_overhead.py --drafter dspark-5l-xl --dtype bfloat16 --runner compiled --out RUNS/rows

Two drafters with the same weights draft the same held-out prompts (greedy, every round drafting γ,
concurrency 1): one whose head step keeps the Markov head's correction rows
(:mod:`dspark.drafters.dspark.rows`) and one whose step computes them afresh. The passes alternate
(kept, fresh, kept, …) on one target; each round's parts come from the drafter's own timings
(``DraftingLoop.timings``: the sequential head's steps, the round after the context ingest). Writes
OUT/head_rows.md and OUT/head_rows.json with the machine named.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch

import dspark
import dspark.drafters.dspark.graphs as dspark_graphs
from dspark.autotune import Machine
from dspark.data.prompts import prompt_request
from dspark.engine import encode_prompt
from dspark.evaluation.inputs import eval_prompts
from dspark.fast.drafter import use_draft_runner
from dspark.types import SamplingParams

SHIPPED_PROMPTS = Path(dspark.__file__).parent / "data" / "natural_eval.jsonl"


def draft_pass(target, drafter, ids, max_new_tokens: int) -> list[dict[str, float]]:
    """Generate each prompt alone, every round drafting γ; each round's timings (seconds)."""
    engine = dspark.Engine(target, drafter, scheduler=dspark.get_scheduler("fixed", k=drafter.gamma),
                           calibrator="identity")
    rounds = []
    inner = drafter.loop.round_fn

    def timed(loop, context, feats):
        block = inner(loop, context, feats)
        rounds.append(dict(loop.timings))
        return block

    drafter.loop.round_fn = timed
    try:
        for x in ids:
            engine.generate([x], SamplingParams.greedy(), max_new_tokens=max_new_tokens, progress=False)
    finally:
        drafter.loop.round_fn = inner
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="dspark-5l-xl", help="NAME[:vocab=K]")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--step", default="compiled", choices=["eager", "packed", "compiled"])
    p.add_argument("--runner", default="compiled", choices=["eager", "compiled"])
    p.add_argument("--prompts", default=str(SHIPPED_PROMPTS))
    p.add_argument("--per-domain", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = dspark.load_target(args.target, getattr(torch, args.dtype), path=args.step)
    ids = [encode_prompt(target.tokenizer, prompt_request(q)) for q in eval_prompts(args.prompts, args.per_domain)]
    drafters = {}
    for mode in ("kept", "fresh"):
        drafter = dspark.from_pretrained(args.drafter, target=target)
        use_draft_runner(drafter, args.runner)
        original = dspark_graphs.caches_rows
        if mode == "fresh":  # the graphs are built at the first round: build them uncached now
            dspark_graphs.caches_rows = lambda head, device: False
        try:
            draft_pass(target, drafter, ids[:1], 8)  # warm-up (compiles a compiled runner's graphs)
        finally:
            dspark_graphs.caches_rows = original
        drafters[mode] = drafter
    rounds: dict[str, list[dict[str, float]]] = {"kept": [], "fresh": []}
    for i in range(args.passes):
        for mode, drafter in drafters.items():
            rounds[mode] += draft_pass(target, drafter, ids, args.max_new_tokens)
            logging.info("pass %d/%d %s: %d rounds", i + 1, args.passes, mode, len(rounds[mode]))
    step = drafters["kept"].loop.runner._graphs["head"][0]
    rows = getattr(step, "rows", None)
    summary = {mode: {part: 1e3 * statistics.median(r[part] for r in rs) for part in ("sequential_head", "draft", "ingest")}
               for mode, rs in rounds.items()}
    summary["rounds"] = {m: len(rs) for m, rs in rounds.items()}
    summary["hit_rate"] = rows.hits / max(rows.hits + rows.misses, 1) if rows is not None else None
    machine = Machine.current().describe()
    command = ("python scripts/head_rows_overhead.py " + f"--drafter {args.drafter} --dtype {args.dtype} --step {args.step} "
               f"--runner {args.runner} --per-domain {args.per_domain} --max-new-tokens {args.max_new_tokens} "
               f"--passes {args.passes} --out RUNS/rows")
    lines = [f"# The sequential head with its correction rows kept\n\nMachine: {machine}\n\n`{command}`\n",
             f"{len(ids)} prompts × {args.max_new_tokens} tokens, greedy, every round drafting γ, one request; "
             f"median per round over {args.passes} alternating passes; rows read back: "
             + (f"{summary['hit_rate']:.1%}" if rows is not None else "(this head keeps none)") + "\n",
             "| head step | sequential head (γ steps) | round after the ingest | ingest | rounds |",
             "|---|---|---|---|---|"]
    for mode in ("fresh", "kept"):
        s = summary[mode]
        lines.append(f"| {'rows kept' if mode == 'kept' else 'computed afresh'} | {s['sequential_head']:.2f} ms | "
                     f"{s['draft']:.2f} ms | {s['ingest']:.2f} ms | {summary['rounds'][mode]} |")
    (out / "head_rows.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "head_rows.json").write_text(json.dumps({"machine": machine, "command": command, **summary}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
