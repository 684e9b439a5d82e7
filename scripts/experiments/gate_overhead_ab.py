"""A/B of what a never-drafting gated engine costs: plain decoding vs sps-greedy with the draft gate
and a prior under which it never drafts, the same closed-loop workload as `dspark bench` (c users,
`--requests` requests, joins as requests finish), interleaved repeats, per-round ms.
    python scripts/experiments/gate_overhead_ab.py PROFILE.json GATE_PRIOR.json CONCURRENCY [REPEATS]
        [--dtype float32|bfloat16] [--requests N] [--drafter SPEC]
(PROFILE / GATE_PRIOR: a `dspark bench` run's profile.json and gate_prior.json; --requests defaults
to CONCURRENCY, all admitted at once)."""
import argparse
import json
import statistics
import time

import torch

import dspark
from dspark.bench.runner import build_engine, parse_scheduler_spec, run_level
from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.engine import encode_prompt
from dspark.evaluation.drafter_specs import load_drafter_spec
from dspark.evaluation.inputs import eval_prompts
from dspark.gate_forecast import GatePrior
from dspark.targets import load_target
from dspark.types import SamplingParams

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("profile")
ap.add_argument("gate_prior")
ap.add_argument("concurrency", type=int)
ap.add_argument("repeats", type=int, nargs="?", default=3)
ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
ap.add_argument("--requests", type=int, default=None)
ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="a drafter spec as `dspark bench --drafter` takes")
args = ap.parse_args()

torch.set_num_threads(2)
target = load_target("smollm2-135m", getattr(torch, args.dtype))
label, drafter, cal = load_drafter_spec(args.drafter, target)
cost = dspark.get_cost_model("sps-table", profile=dspark.cost_models.SPSProfile.from_json(args.profile))
prior = GatePrior.from_dict(json.load(open(args.gate_prior)))
ids = [encode_prompt(target.tokenizer, p.text) for p in eval_prompts(None, 4)]
n = args.requests or args.concurrency
specs = {"plain": parse_scheduler_spec("plain"), "gated": parse_scheduler_spec("sps-greedy")}
per_round = {k: [] for k in specs}
for rep in range(args.repeats):
    for kind in (("plain", "gated") if rep % 2 == 0 else ("gated", "plain")):
        engine = build_engine(target, drafter, specs[kind], cost, cal, gate=kind == "gated", prior=prior)
        t = time.perf_counter()
        run = run_level(engine, ids, label=kind, concurrency=args.concurrency, num_requests=n,
                        sampling=SamplingParams.greedy(), max_new_tokens=64)
        wall = time.perf_counter() - t
        rounds = run.rounds
        ms = 1e3 * sum(r.seconds for r in rounds) / len(rounds)
        tgt = 1e3 * statistics.median(r.target_seconds for r in rounds)
        per_round[kind].append(ms)
        print(rep, kind, f"{wall:.2f} s, {len(rounds)} rounds, {sum(r.drafted for r in rounds)} drafted, "
              f"{ms:.2f} ms/round, target median {tgt:.2f} ms, prefill "
              f"{sum(q.prefill_seconds for q in run.requests):.2f} s", flush=True)
print("median ms/round:", {k: round(statistics.median(v), 2) for k, v in per_round.items()})
