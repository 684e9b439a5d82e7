"""A draft-gate prior as `dspark bench --gate-prior measure` builds one, for scripts that start
engines themselves (scripts/experiments/lockstep_ab.py --gate-prior): the acceptance survival of rounds with
every position verified, and the drafted-round overhead timed at each R.

    python scripts/gate_prior.py PROFILE.json OUT.json [--levels 1,2,4,8,16,32] [--traces ROUNDS.json]
        [--per-domain 4] [--drafter SPEC]

--traces: a recorded Rounds JSON (`dspark bench`'s traces.json); without it the rounds are decoded
here on the shipped held-out prompts (--per-domain each), greedy, bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("out")
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--traces")
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--drafter", default=None)
    args = ap.parse_args(argv)

    import dspark
    from dspark.bench.prior import measure_draft_overhead
    from dspark.checkpoints import DEFAULT_DRAFTER
    from dspark.cost_models import SPSProfile
    from dspark.engine import encode_prompt
    from dspark.evaluation.drafter_specs import load_drafter_spec
    from dspark.evaluation.inputs import eval_prompts
    from dspark.evaluation.rounds import Rounds, collect_rounds
    from dspark.gate_forecast import GatePrior
    from dspark.interop import survival_from_rounds
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    torch.set_num_threads(2)
    target = load_target("smollm2-135m", torch.bfloat16)
    _, drafter, cal = load_drafter_spec(args.drafter or DEFAULT_DRAFTER, target)
    cost = dspark.get_cost_model("sps-table", profile=SPSProfile.from_json(args.profile))
    prompts = eval_prompts(None, args.per_domain)
    if args.traces:
        rounds = Rounds.from_dict(json.loads(Path(args.traces).read_text()))
    else:
        rounds = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), concurrency=16, scheduler="full")
    ids = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    overhead = measure_draft_overhead(target, drafter, ids, [int(x) for x in args.levels.split(",")], cost, cal)
    prior = GatePrior(survival_from_rounds(rounds), overhead)
    Path(args.out).write_text(json.dumps({**prior.to_dict(), "command": " ".join(
        ["python", "scripts/gate_prior.py", *(argv if argv is not None else sys.argv[1:])])}, indent=2) + "\n")
    print(json.dumps(prior.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
