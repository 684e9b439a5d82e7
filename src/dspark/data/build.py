"""``dspark data``: prompts → held-out split → target-written responses on disk (resumable)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_data"]


def run_data(args: Any) -> int:
    import torch

    from dspark.data.prompts import builtin_prompts, jsonl_prompts, split
    from dspark.data.selfdistill import done_keys, generate_records, write_prompts
    from dspark.engine import Engine
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modules = [m.strip() for m in args.code_modules.split(",") if m.strip()] if args.code_modules else None
    prompts = [] if args.no_builtin else builtin_prompts(args.per_domain, args.seed, code_modules=modules)
    for f in args.prompts or ():
        prompts.extend(jsonl_prompts(f))
    if not prompts:
        raise ValueError("no prompts: give --prompts FILE.jsonl or drop --no-builtin")
    train, held = split(prompts, args.eval_fraction)
    write_prompts(out / "eval_prompts.jsonl", held)
    data = out / "train.jsonl"
    done = done_keys(data)
    todo = [p for p in train if p.key not in done]
    print(f"{len(train)} training prompts ({len(done)} already done), {len(held)} held out "
          f"→ {out / 'eval_prompts.jsonl'}", file=sys.stderr)
    sampling = (SamplingParams.greedy() if args.temperature == 0
                else SamplingParams(temperature=args.temperature, top_p=args.top_p))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = Engine(load_target(args.model, dtype), None, seed=args.seed)
    meta = {"model": args.model, "dtype": args.dtype, "temperature": args.temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "eval_fraction": args.eval_fraction, "seed": args.seed,
            "per_domain": args.per_domain, "prompt_files": list(args.prompts or ()),
            "code_modules": modules or "stdlib"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    n_tok = 0
    with data.open("a", encoding="utf-8") as fh:
        for rec in generate_records(engine, todo, sampling, max_new_tokens=args.max_new_tokens,
                                    concurrency=args.concurrency, progress=not args.quiet):
            fh.write(json.dumps(rec.to_dict()) + "\n")
            fh.flush()  # an interrupted run keeps every finished response
            n_tok += len(rec.response_ids)
    print(f"wrote {len(todo)} responses ({n_tok} tokens) to {data}", file=sys.stderr)
    return 0
