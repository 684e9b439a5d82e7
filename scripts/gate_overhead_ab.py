"""A/B of what a never-drafting gated engine costs: plain decoding vs sps-greedy with the draft gate
and a prior under which it never drafts, same prompts, interleaved repeats, per-round ms.
    python scripts/gate_overhead_ab.py PROFILE.json GATE_PRIOR.json CONCURRENCY [REPEATS]
(PROFILE / GATE_PRIOR: a `dspark bench` run's profile.json and gate_prior.json)."""
import json
import sys
import time

import torch

import dspark
from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.engine import Engine, encode_prompt
from dspark.evaluation_runs import eval_prompts, load_drafter_spec
from dspark.gating import DraftGate, GatePrior
from dspark.targets import load_target
from dspark.types import SamplingParams

torch.set_num_threads(2)
target = load_target("smollm2-135m", torch.bfloat16)
label, drafter, cal = load_drafter_spec(DEFAULT_DRAFTER, target)
prof = dspark.cost_models.SPSProfile.from_json(sys.argv[1])
cost = dspark.get_cost_model("sps-table", profile=prof)
prior = GatePrior.from_dict(json.load(open(sys.argv[2])))
prompts = eval_prompts(None, 4)
ids = [encode_prompt(target.tokenizer, p.text) for p in prompts]
C = int(sys.argv[3])
ids = (ids * 6)[:C]
def run(kind):
    if kind == "plain":
        target.set_capture_layers(())
        e = Engine(target, None, cost_model=cost)
    else:
        e = Engine(target, drafter, scheduler=dspark.get_scheduler("sps-greedy"), cost_model=cost, calibrator=cal, draft_gate=DraftGate(prior=prior))
    t = time.perf_counter()
    e.generate(ids, SamplingParams.greedy(), max_new_tokens=64, progress=False)
    return time.perf_counter() - t, e
for rep in range(int(sys.argv[4]) if len(sys.argv) > 4 else 3):
    for k in ("plain", "gated"):
        s, e = run(k)
        print(rep, k, f"{s:.2f} s", e.rounds, "rounds,", f"{1e3 * e.timings['round'] / e.rounds:.2f} ms/round,",
              f"{1e3 * e.timings['target'] / e.rounds:.2f} ms target")
