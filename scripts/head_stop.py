"""The sequential head stopping where the schedule ends the draft (dspark.round.schedule_stop),
side by side with the head stepping γ times, at one request as the demo runs it.

    python scripts/head_stop.py --out RUNS/head_stop [--tokens 64] [--repeats 3]

The compiled bf16 target, the shipped drafter with its measured vocabulary cut on the compiled
draft runner, its calibrator and the draft head's confidences, greedy; the cost model is the
verification profile t(1..γ+1) measured here first. For each scheduler (``sps-greedy``, the
demo's, and ``fixed:k=3``), passes with the rule on and off alternate ``--repeats`` times over
the same three prompts, after a warm-up pass that compiles every graph. Per pass: rounds, τ,
ms per round and per token, the draft's and the sequential head's ms per round, and head steps
per round. The rule is exact, so both passes must commit the same tokens in the same rounds; the
script checks that and fails loudly otherwise. Writes ``head_stop.json`` and ``head_stop.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("head_stop")

PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
           "Explain the water cycle briefly.",
           "Solve: 12 * (3 + 4) - 5 = ?")
SCHEDULERS = {"sps-greedy": ("sps-greedy", {}), "fixed:k=3": ("fixed", {"k": 3})}  # label → (name, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    import dspark
    import dspark.round
    from dspark.autotune import measure_profile, profile_cost_model
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
    from dspark.drafters.loop import GraphCalls
    from dspark.drafters.vocab_cut import raceable_cut
    from dspark.engine import Engine, encode_prompt
    from dspark.evaluation.drafter_specs import calibrator_beside
    from dspark.fast.drafter import use_draft_runner
    from dspark.profiling import device_name
    from dspark.types import SamplingParams

    target = dspark.load_target("smollm2-135m", torch.bfloat16, path="compiled")
    folder = resolve_checkpoint(DEFAULT_DRAFTER)
    cut, _ = raceable_cut(folder)
    drafter = dspark.from_pretrained(DEFAULT_DRAFTER, target=target, draft_vocab=cut.draft_vocab if cut else None)
    runner_name = use_draft_runner(drafter, "compiled")
    calibrator = calibrator_beside(folder, None)  # the head's calibration.json
    ids = [encode_prompt(target.tokenizer, text) for text in PROMPTS]
    context = round(statistics.mean(x.numel() for x in ids)) + args.tokens // 2
    profile = measure_profile(target, context, range(1, drafter.gamma + 2))
    cost = profile_cost_model(profile, dtype="bfloat16", model="smollm2-135m", device=device_name(None))
    log.info("verification profile: %s", ", ".join(f"q={q}: {s * 1e3:.1f} ms" for q, s in profile.items()))

    real_rule = dspark.round.schedule_stop

    def one_pass(spec: str, rule: bool, tokens: int) -> dict:
        name, kwargs = SCHEDULERS[spec]
        engine = Engine(target, drafter, scheduler=dspark.get_scheduler(name, **kwargs), cost_model=cost,
                        calibrator=calibrator, confidence_model="draft-head")
        dspark.round.schedule_stop = real_rule if rule else (lambda *a, **k: None)
        outputs = []
        t0 = time.perf_counter()
        try:
            with GraphCalls(drafter.loop.runner) as calls:
                for x in ids:
                    (done,) = engine.generate([x], SamplingParams.greedy(), max_new_tokens=tokens, progress=False)
                    outputs.append(done.output_ids)
        finally:
            dspark.round.schedule_stop = real_rule
        wall = time.perf_counter() - t0
        n = engine.rounds
        committed = sum(len(o) for o in outputs)
        return {"scheduler": spec, "rule": rule, "rounds": n, "tau": committed / n,
                "ms_per_round": 1e3 * wall / n, "ms_per_token": 1e3 * wall / committed,
                "draft_ms": 1e3 * engine.timings["draft"] / n,
                "sequential_head_ms": 1e3 * engine.timings["sequential_head"] / n,
                "head_steps_per_round": calls.count("head") / n, "outputs": outputs}

    t0 = time.perf_counter()
    for spec in SCHEDULERS:
        for rule in (True, False):
            one_pass(spec, rule, 24)
    log.info("warm-up (compiling) took %.0f s", time.perf_counter() - t0)
    passes = []
    for _ in range(args.repeats):
        for spec in SCHEDULERS:
            for rule in (True, False):
                passes.append(one_pass(spec, rule, args.tokens))
                log.info("%s", {k: v for k, v in passes[-1].items() if k != "outputs"})
    for on in (r for r in passes if r["rule"]):
        off = next(r for r in passes if not r["rule"] and r["scheduler"] == on["scheduler"])
        if on["outputs"] != off["outputs"] or on["rounds"] != off["rounds"]:
            raise SystemExit(f"{on['scheduler']}: the rule changed the output or the rounds "
                             f"({on['rounds']} against {off['rounds']}): it is not exact")
    result = {"machine": device_name(None), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "target_path": target.path, "draft_runner": runner_name, "calibrator": calibrator.name,
              "draft_vocab": cut.draft_vocab if cut else None, "tokens": args.tokens,
              "profile_ms": {q: 1e3 * s for q, s in profile.items()},
              "passes": [{k: v for k, v in r.items() if k != "outputs"} for r in passes]}
    (args.out / "head_stop.json").write_text(json.dumps(result, indent=2) + "\n")

    def median(spec: str, rule: bool, key: str) -> float:
        return statistics.median(r[key] for r in passes if r["scheduler"] == spec and r["rule"] == rule)

    keys = ("rounds", "tau", "ms_per_round", "ms_per_token", "draft_ms", "sequential_head_ms", "head_steps_per_round")
    lines = [f"{result['machine']}, torch {result['torch']}, {result['threads']} threads: one request, bf16 "
             f"{target.path} target, drafter on the {runner_name} runner (vocabulary "
             f"{result['draft_vocab'] or 'full'}), calibrator {calibrator.name}, greedy; medians of "
             f"{args.repeats} alternating passes", "",
             "| scheduler | head stops | rounds | τ | ms / round | ms / token | draft ms | head ms | head steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spec in SCHEDULERS:
        for rule in (True, False):
            v = [median(spec, rule, k) for k in keys]
            lines.append(f"| {spec} | {'at the schedule' if rule else 'after γ steps'} | {v[0]:.0f} | {v[1]:.2f} | "
                         f"{v[2]:.2f} | {v[3]:.2f} | {v[4]:.2f} | {v[5]:.2f} | {v[6]:.2f} |")
    (args.out / "head_stop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
