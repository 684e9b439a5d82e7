"""A/B at low concurrency (docs/serving-and-benchmarks.md): sps-greedy + draft gate with target features captured always vs within capture_ahead = 16 rounds of a probe, next to plain and fixed:k=7; 8+ requests x 64 tokens, 3 repeats rotated.

    python scripts/experiments/capture_ab.py PROFILE.json 1,4
"""
import statistics
import sys

import torch

import dspark
from dspark.bench.records import summarise_run
from dspark.bench.runner import run_level
from dspark.engine import Engine, encode_prompt
from dspark.evaluation.drafter_specs import load_drafter_spec
from dspark.evaluation.inputs import eval_prompts
from dspark.gating import DraftGate

torch.set_num_threads(2)
t = dspark.load_target("smollm2-135m", torch.bfloat16)
label, drafter, cal = load_drafter_spec("dspark-vanilla-ref=data/smollm2-135m/retired/dspark-vanilla-ref", t)  # the drafter it measured
ids = [encode_prompt(t.tokenizer, p.text) for p in eval_prompts(None, 4)]
cost = dspark.get_cost_model("sps-table", profile=sys.argv[1])
C = [int(x) for x in sys.argv[2].split(",")]
variants = ["plain", "fixed7", "always", "ahead16"]
res = {}
for rep in range(3):
    for c in C:
        order = variants[rep % 4:] + variants[: rep % 4]
        for v in order:
            if v == "plain":
                t.set_capture_layers(())
                e = Engine(t, None, cost_model=cost)
            elif v == "fixed7":
                e = Engine(t, drafter, scheduler=dspark.get_scheduler("fixed", k=7), cost_model=cost, calibrator=cal or "identity")
            else:
                e = Engine(t, drafter, scheduler="sps-greedy", cost_model=cost, calibrator=cal or "identity",
                           draft_gate=DraftGate(), capture_ahead=10**9 if v == "always" else 16)
            run = run_level(e, ids, label=v, concurrency=c, num_requests=max(2 * c, 8), sampling=dspark.SamplingParams.greedy(), max_new_tokens=64)
            s = summarise_run(run)
            res.setdefault((c, v), []).append(s["throughput_tok_s"])
            print(f"rep{rep} c={c} {v}: {s['throughput_tok_s']:.1f} tok/s drafted {s['drafted_fraction']:.2f} lbar {s['mean_verified']:.2f} tau {s['tau']:.2f}", flush=True)
for c in C:
    p = statistics.median(res[c, "plain"])
    print("c", c, {v: round(statistics.median(res[c, v]) / p, 3) for v in variants})
