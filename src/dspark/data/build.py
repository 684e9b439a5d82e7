"""``dspark data``: prompts → held-out split → target-written responses on disk (resumable)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_data"]

SOURCES = ("builtin", "natural", "both")


def _check_sources(args: Any) -> tuple[str, str | None]:
    """(--source, --followups-from) after the checks that need no model."""
    source, followups_from = getattr(args, "source", "builtin"), getattr(args, "followups_from", None)
    if source not in SOURCES:
        raise ValueError(f"--source must be one of {', '.join(SOURCES)}, not {source!r}")
    if args.no_builtin and source != "builtin":
        raise ValueError(f"--no-builtin (only the --prompts files) contradicts --source {source}")
    if followups_from and source == "builtin":
        raise ValueError("--followups-from needs --source natural or both (follow-ups are natural prompts)")
    if followups_from and not Path(followups_from).is_file():
        raise FileNotFoundError(f"--followups-from {followups_from} does not exist "
                                "(give a train.jsonl written by `dspark data`)")
    return source, followups_from


def _merge(train: list, held: list, more_train: list, more_held: list) -> tuple[list, list]:
    """Both splits extended, de-duplicated by key; a prompt held out by either stays held out."""
    first_held = {p.key for p in held}
    held = held + [p for p in more_held if p.key not in first_held]
    held_keys = first_held | {p.key for p in more_held}
    train_keys: set[str] = set()
    out = []
    for p in train + more_train:
        if p.key not in held_keys and p.key not in train_keys:
            train_keys.add(p.key)
            out.append(p)
    return out, held


def run_data(args: Any) -> int:
    import torch

    from dspark.data.prompts import DOMAINS, builtin_prompts, jsonl_prompts, split
    from dspark.data.selfdistill import done_keys, generate_records, write_prompts
    from dspark.engine import Engine
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    source, followups_from = _check_sources(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modules = [m.strip() for m in args.code_modules.split(",") if m.strip()] if args.code_modules else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    use_builtin = source != "natural" and not args.no_builtin
    prompts = builtin_prompts(args.per_domain, args.seed, code_modules=modules) if use_builtin else []
    for f in args.prompts or ():
        prompts.extend(jsonl_prompts(f))
    if not prompts and source == "builtin":
        raise ValueError("no prompts: give --prompts FILE.jsonl or drop --no-builtin")
    train, held = split(prompts, args.eval_fraction)  # builtin and files: by prompt hash
    target = None
    if source != "builtin":  # natural: by source unit (see dspark.data.natural)
        from dspark.data.natural import load_followups, natural_split

        followups = []
        if followups_from:
            target = load_target(args.model, dtype)  # its tokenizer decodes the recorded responses
            tok = getattr(target, "tokenizer", None)
            decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
            followups = load_followups(followups_from, decode, seed=args.seed)
        nat_train, nat_held = natural_split(args.per_domain, args.seed, args.eval_fraction, followups=followups)
        counts = {d: sum(p.domain == d for p in nat_train + nat_held) for d in DOMAINS}
        print(f"natural prompts per domain (train + held out): {counts}"
              + (f", {sum(p.messages is not None for p in nat_train + nat_held)} multi-turn" if followups else ""),
              file=sys.stderr)
        train, held = _merge(train, held, nat_train, nat_held)
        if not train:
            raise ValueError("no training prompts: the natural source yielded none (is --per-domain 0?)")
    write_prompts(out / "eval_prompts.jsonl", held)
    data = out / "train.jsonl"
    done = done_keys(data)
    # In key (sha1) order: domains and sources interleave, so an interrupted run holds a balanced sample.
    todo = sorted((p for p in train if p.key not in done), key=lambda p: p.key)
    print(f"{len(train)} training prompts ({len(done)} already done), {len(held)} held out "
          f"→ {out / 'eval_prompts.jsonl'}", file=sys.stderr)
    sampling = (SamplingParams.greedy() if args.temperature == 0
                else SamplingParams(temperature=args.temperature, top_p=args.top_p))
    engine = Engine(target or load_target(args.model, dtype), None, seed=args.seed)
    meta = {"model": args.model, "dtype": args.dtype, "temperature": args.temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "eval_fraction": args.eval_fraction, "seed": args.seed,
            "per_domain": args.per_domain, "prompt_files": list(args.prompts or ()),
            "code_modules": modules or "stdlib", "source": source, "followups_from": followups_from}
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
