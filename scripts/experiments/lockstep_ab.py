"""Schedulers side by side in lockstep: one round of each engine in turn, so that the VM's speed
drifts (±40 % within a minute on the 2-core VMs) fall on every engine alike.

    python scripts/experiments/lockstep_ab.py PROFILE.json --concurrency 1 --entries plain fixed:k=7 sps-greedy \\
        [--gate sps-greedy] [--requests 6] [--max-new-tokens 64] [--out OUT.json]

Every entry serves the same closed loop (c users, the shipped held-out prompts cycled, joins as
requests finish) through its own engine over one shared bf16 model. Per entry: wall seconds in
rounds, new tokens, tok/s and its ratio to the first entry, the mean draft and target parts of a
round, and the median target step per batch size B (is a B-token verification dearer under one
scheduler than under another?). Prefill is excluded (each engine's add_request runs outside the
timed rounds). ``--gate NAME`` runs that entry with the draft gate, starting from
``--gate-prior`` where given (as `dspark bench` does; without one it learns from its own rounds).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="an sps-table profile JSON (`dspark profile`)")
    ap.add_argument("--entries", nargs="+", default=["plain", "fixed:k=7", "sps-greedy"])
    ap.add_argument("--gate", action="append", default=[], help="entry run with the draft gate (repeatable)")
    ap.add_argument("--gate-option", action="append", default=[], metavar="ENTRY:KEY=VALUE",
                    help="set a DraftGate field on that entry's gate, e.g. sps-greedy@raw:speed_normalised=false "
                         "(repeatable; ENTRY@LABEL runs a scheduler twice under different names)")
    ap.add_argument("--gate-prior", help="a GatePrior JSON (`dspark bench`'s gate_prior.json) for the gated entries")
    ap.add_argument("--entry-prior", action="append", default=[], metavar="ENTRY=FILE",
                    help="a GatePrior JSON for one gated entry instead of --gate-prior (repeatable)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default=None, help="drafter spec (default: the shipped default)")
    ap.add_argument("--out")
    ap.add_argument("--trace", action="store_true",
                    help="also write every turn: per entry [R, drafted, tokens committed, round ms] (is a gate's decision following "
                         "the VM's drift? plain's round in the same turn is the reference)")
    args = ap.parse_args(argv)

    import dspark
    from dspark.bench.runner import build_engine, parse_scheduler_spec
    from dspark.checkpoints import DEFAULT_DRAFTER
    from dspark.cost_models import SPSProfile
    from dspark.engine import encode_prompt
    from dspark.evaluation.drafter_specs import load_drafter_spec
    from dspark.evaluation.inputs import eval_prompts
    from dspark.gate_forecast import GatePrior
    from dspark.models import load_causal_lm
    from dspark.targets import HFTarget
    from dspark.types import SamplingParams

    torch.set_num_threads(2)
    model, tok = load_causal_lm("smollm2-135m", torch.bfloat16)
    cost = dspark.get_cost_model("sps-table", profile=SPSProfile.from_json(args.profile))
    def read_prior(path: str | None) -> GatePrior | None:
        return GatePrior.from_dict(json.loads(Path(path).read_text())) if path else None

    priors = dict(e.split("=", 1) for e in args.entry_prior)
    prompts = [encode_prompt(tok, p.text) for p in eval_prompts(None, max(1, -(-args.requests // 3)))][: args.requests]
    systems = {}
    for name in args.entries:
        target = HFTarget(model, tok)
        _, drafter, cal = load_drafter_spec(args.drafter or DEFAULT_DRAFTER, target)
        systems[name] = build_engine(target, drafter, parse_scheduler_spec(name.split("@")[0]), cost, cal,
                                     gate=name in args.gate, prior=read_prior(priors.get(name, args.gate_prior)))
    for opt in args.gate_option:
        entry, _, kv = opt.partition(":")
        key, _, value = kv.partition("=")
        gate = systems[entry].draft_gate if entry in systems else None
        if gate is None or not hasattr(gate, key):
            raise SystemExit(f"--gate-option {opt!r}: {entry!r} is not a gated entry with a field {key!r}")
        old = getattr(gate, key)
        setattr(gate, key, value.lower() in ("1", "true", "yes") if isinstance(old, bool) else type(old)(value))
    pending = {n: list(range(len(prompts)))[::-1] for n in systems}
    live = dict.fromkeys(systems, 0)
    stats = {n: {"seconds": 0.0, "tokens": 0, "rounds": 0, "draft": 0.0, "target": 0.0, "drafted": 0,
                 "full_seconds": 0.0, "full_tokens": 0, "by_B": collections.defaultdict(list)} for n in systems}
    greedy = SamplingParams.greedy()
    turn = 0
    trace: list[dict] = []
    while any(pending[n] or live[n] for n in systems):
        names = list(systems)
        names = names[turn % len(names):] + names[: turn % len(names)]  # rotate who goes first
        turn += 1
        row: dict = {}
        for n in names:
            e = systems[n]
            while pending[n] and live[n] < args.concurrency:
                e.add_request(prompts[pending[n].pop()], greedy, max_new_tokens=args.max_new_tokens)
                live[n] += 1
            if not live[n]:
                continue
            t0 = time.perf_counter()
            out = e.step()
            dt = time.perf_counter() - t0
            s, info = stats[n], e.last_round
            s["seconds"] += dt
            committed = sum(len(o.new_tokens) for o in out)
            s["tokens"] += committed
            s["rounds"] += 1
            s["draft"] += info.draft_seconds
            s["target"] += info.target_seconds
            s["drafted"] += int(info.drafted)
            s["by_B"][info.batch_size].append(info.target_seconds)
            if info.num_requests == args.concurrency:  # steady state: the closed loop's tail runs fewer requests
                s["full_seconds"] += dt
                s["full_tokens"] += committed
            live[n] -= len(e.pop_finished())
            row[n] = [info.num_requests, int(info.drafted), committed, round(1e3 * dt, 2)]
        if args.trace:
            trace.append(row)
    first = args.entries[0]
    base = stats[first]["tokens"] / stats[first]["seconds"]
    full_base = stats[first]["full_tokens"] / max(stats[first]["full_seconds"], 1e-12)
    rows = {}
    for n, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        full = s["full_tokens"] / max(s["full_seconds"], 1e-12)
        # at full concurrency only: the tail (fewer than c requests left) differs between entries, whose
        # requests finish in different orders, and is a lower concurrency level
        rows[n] = {"tok_s": round(tps, 2), "ratio": round(tps / base, 3), "full_tok_s": round(full, 2),
                   "full_ratio": round(full / max(full_base, 1e-12), 3), "full_tokens": s["full_tokens"],
                   "tokens": s["tokens"], "rounds": s["rounds"],
                   "round_ms": round(1e3 * s["seconds"] / s["rounds"], 2), "draft_ms": round(1e3 * s["draft"] / s["rounds"], 2),
                   "target_ms": round(1e3 * s["target"] / s["rounds"], 2), "drafted": s["drafted"],
                   "target_ms_by_B": {b: [round(1e3 * statistics.median(v), 2), len(v)] for b, v in sorted(s["by_B"].items())}}
        print(n, json.dumps(rows[n]), flush=True)
    result = {"concurrency": args.concurrency, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "profile": args.profile, "rows": rows, **({"trace": trace} if args.trace else {}), "command": " ".join(["python", "scripts/experiments/lockstep_ab.py", *(argv or sys.argv[1:])])}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
