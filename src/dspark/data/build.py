"""``dspark data``: prompts → held-out split → target-written responses on disk (resumable).

The library function is :func:`build_data` (a :class:`DataOptions` in, a :class:`DataResult`
out); the command line maps its arguments onto the options and prints the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from attrs import frozen

from dspark.options import (
    DEVICE_HELP,
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    existing_device,
    option,
    optional_path,
    path,
    resolve_options,
    strings,
    unit_interval,
)

__all__ = ["DataOptions", "DataResult", "build_data"]

SOURCES = ("builtin", "natural", "both")


def _code_modules(value: str | Any) -> tuple[str, ...] | None:
    """``"numpy, torch.nn.functional"`` (the command line's form) or a sequence of module names."""
    if value is None or (isinstance(value, str) and not value):
        return None
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(m.strip() for m in parts if m.strip())


@frozen
class DataOptions(NamespaceOptions):
    """What ``dspark data`` builds: each field is an option of the command (:func:`dspark.options.option`)."""

    out: str = option("data/smollm2", converter=path, help="folder for train.jsonl, eval_prompts.jsonl, meta.json")
    per_domain: int = option(600, validator=at_least(0),
                             help="generated prompts per domain (math, code, chat) and per source")
    source: str = option("builtin", choices=SOURCES,
                         help="generated prompts: builtin templates, natural prompts from the documentation, code "
                         "and real text of installed packages (dspark.data.natural), or both")
    followups_from: str | None = option(None, converter=optional_path, metavar="PATH",
                                        help="a train.jsonl written by `dspark data`: adds multi-turn chat prompts (the "
                                        "target's recorded response + a follow-up question) to the natural source")
    prompts: tuple[str, ...] = option((), converter=strings, help="JSONL prompt file (repeatable): {prompt, domain?}")
    no_builtin: bool = option(False, help="only the --prompts files")
    code_modules: tuple[str, ...] | None = option(None, converter=_code_modules, type=str,
                                                  help="comma-separated importable modules whose documented functions "
                                                  "become code prompts (default: a set of standard-library modules), "
                                                  "e.g. numpy,torch.nn.functional")
    eval_fraction: float = option(0.1, validator=unit_interval(open_high=True),
                                  help="fraction of the prompts held out for evaluation")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    dtype: str = option("bfloat16", choices=("float32", "bfloat16"), help="the target's dtype")
    device: str = option("cpu", validator=existing_device, help=DEVICE_HELP)
    temperature: float = option(0.7, validator=at_least(0, integer=False), help="sampling temperature of the responses")
    top_p: float = option(0.95, validator=unit_interval(open_low=True), help="nucleus (top-p) mass of the sampling")
    max_new_tokens: int = option(128, validator=at_least(1), help="longest response in tokens")
    concurrency: int = option(32, validator=at_least(1), help="prompts the target answers at once")
    max_tokens: int = option(0, validator=at_least(0),
                             help="stop once train.jsonl holds this many response tokens, earlier runs included (0: "
                             "answer every prompt); prompts run in key order, so the sample stays balanced across domains")
    seed: int = option(0, help="random seed")
    quiet: bool = False  # the global -q

    def __attrs_post_init__(self) -> None:
        if self.no_builtin and self.source != "builtin":
            raise ValueError(f"--no-builtin (only the --prompts files) contradicts --source {self.source}")
        if self.followups_from and self.source == "builtin":
            raise ValueError("--followups-from needs --source natural or both (follow-ups are natural prompts)")
        if self.no_builtin and not self.prompts:
            raise ValueError("no prompts: give --prompts FILE.jsonl or drop --no-builtin")


@frozen
class DataResult:
    """What :func:`build_data` wrote: the folder, its files and the counts."""

    out: Path
    train_prompts: int  # training prompts in all (responses already written included)
    already_done: int  # of them, answered by an earlier run
    held_out: int  # prompts written to eval_prompts.jsonl
    written: int  # responses written by this call
    tokens: int  # response tokens written by this call
    total_tokens: int = 0  # response tokens train.jsonl holds now (earlier runs included)

    @property
    def train_path(self) -> Path:
        return self.out / "train.jsonl"

    @property
    def eval_prompts_path(self) -> Path:
        return self.out / "eval_prompts.jsonl"

    @property
    def meta_path(self) -> Path:
        return self.out / "meta.json"


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


def _drop_torn_tail(path: Path) -> None:
    """Cut a data file back to its last complete line (an interrupted writer, or a copy taken
    while one was writing, can end mid-record); a file ending in a newline is left untouched."""
    if not path.is_file():
        return
    with path.open("r+b") as fh:
        size = fh.seek(0, 2)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        keep, pos = 0, size  # scan back in blocks for the last newline
        while pos > 0 and not keep:
            start = max(0, pos - 65536)
            fh.seek(start)
            nl = fh.read(pos - start).rfind(b"\n")
            keep, pos = (start + nl + 1 if nl >= 0 else 0), start
        fh.truncate(keep)
        print(f"{path}: dropped a torn last record ({size - keep} bytes) before resuming", file=sys.stderr)


def build_data(options: DataOptions | None = None, /, **overrides: Any) -> DataResult:
    """Self-distillation data: prompts (built-in, natural and/or ``options.prompts`` files), a
    held-out split written to ``eval_prompts.jsonl``, and the target's responses appended to
    ``train.jsonl`` (a re-run resumes). ``overrides`` replace fields of ``options`` (or of the
    defaults)."""
    import torch

    from dspark.data.prompts import DOMAINS, builtin_prompts, jsonl_prompts, split
    from dspark.data.selfdistill import generate_records, read_records, write_prompts
    from dspark.engine import Engine
    from dspark.models import model_identity
    from dspark.provenance import check, record
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    opts = resolve_options(DataOptions, options, overrides)
    source, followups_from = opts.source, opts.followups_from
    if followups_from and not Path(followups_from).is_file():
        raise FileNotFoundError(f"--followups-from {followups_from} does not exist "
                                "(give a train.jsonl written by `dspark data`)")
    out = Path(opts.out)
    # a resume appends to train.jsonl: only with the settings its records were generated with
    generation = {"model": opts.model, "dtype": opts.dtype, "temperature": opts.temperature, "top_p": opts.top_p,
                  "max_new_tokens": opts.max_new_tokens, "seed": opts.seed}
    resuming = (out / "train.jsonl").is_file() and (out / "train.jsonl").stat().st_size > 0
    if resuming:  # the cheap fields before the model loads, its weights' digest after
        check(out / "train.provenance.json", {k: v for k, v in generation.items()}, f"{out / 'train.jsonl'}",
              "resume with the same settings, or choose another --out", ignore=("target",))
    out.mkdir(parents=True, exist_ok=True)
    modules = list(opts.code_modules) if opts.code_modules is not None else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]
    use_builtin = source != "natural" and not opts.no_builtin
    prompts = builtin_prompts(opts.per_domain, opts.seed, code_modules=modules) if use_builtin else []
    for f in opts.prompts:
        prompts.extend(jsonl_prompts(f))
    if not prompts and source == "builtin":
        raise ValueError("no prompts: give --prompts FILE.jsonl or drop --no-builtin")
    train, held = split(prompts, opts.eval_fraction)  # builtin and files: by prompt hash
    target = None
    if source != "builtin":  # natural: by source unit (see dspark.data.natural)
        from dspark.data.natural import load_followups, natural_split

        followups = []
        if followups_from:
            target = load_target(opts.model, dtype, device=opts.device)  # its tokenizer decodes the recorded responses
            tok = getattr(target, "tokenizer", None)
            decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
            followups = load_followups(followups_from, decode, seed=opts.seed)
        nat_train, nat_held = natural_split(opts.per_domain, opts.seed, opts.eval_fraction, followups=followups)
        counts = {d: sum(p.domain == d for p in nat_train + nat_held) for d in DOMAINS}
        print(f"natural prompts per domain (train + held out): {counts}"
              + (f", {sum(p.messages is not None for p in nat_train + nat_held)} multi-turn" if followups else ""),
              file=sys.stderr)
        train, held = _merge(train, held, nat_train, nat_held)
        if not train:
            raise ValueError("no training prompts: the natural source yielded none (is --per-domain 0?)")
    write_prompts(out / "eval_prompts.jsonl", held)
    data = out / "train.jsonl"
    written_before = read_records(data) if data.is_file() else []
    _drop_torn_tail(data)  # read_records skipped it; appending after it would corrupt the next record
    done = {r.key for r in written_before}
    had = sum(len(r.response_ids) for r in written_before)  # response tokens already written
    # In key (sha1) order: domains and sources interleave, so an interrupted run holds a balanced sample.
    todo = sorted((p for p in train if p.key not in done), key=lambda p: p.key)
    print(f"{len(train)} training prompts ({len(done)} already done), {len(held)} held out "
          f"→ {out / 'eval_prompts.jsonl'}", file=sys.stderr)
    sampling = (SamplingParams.greedy() if opts.temperature == 0
                else SamplingParams(temperature=opts.temperature, top_p=opts.top_p))
    engine = Engine(target or load_target(opts.model, dtype, device=opts.device), None, seed=opts.seed)
    generation["target"] = model_identity(engine.target.model)
    if resuming:
        check(out / "train.provenance.json", generation, f"{out / 'train.jsonl'}",
              "resume with the same target, or choose another --out")
    else:
        record(out / "train.provenance.json", generation)
    meta = {"model": opts.model, "dtype": opts.dtype, "temperature": opts.temperature, "top_p": opts.top_p,
            "max_new_tokens": opts.max_new_tokens, "eval_fraction": opts.eval_fraction, "seed": opts.seed,
            "per_domain": opts.per_domain, "prompt_files": list(opts.prompts),
            "code_modules": modules or "stdlib", "source": source, "followups_from": followups_from}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    n_tok = written = 0
    if opts.max_tokens and had >= opts.max_tokens:
        todo = []
        print(f"{data} already holds {had:,} response tokens (--max-tokens {opts.max_tokens:,})", file=sys.stderr)
    with data.open("a", encoding="utf-8") as fh:
        for rec in generate_records(engine, todo, sampling, max_new_tokens=opts.max_new_tokens,
                                    concurrency=opts.concurrency, progress=not opts.quiet):
            fh.write(json.dumps(rec.to_dict()) + "\n")
            fh.flush()  # an interrupted run keeps every finished response
            n_tok += len(rec.response_ids)
            written += 1
            if opts.max_tokens and had + n_tok >= opts.max_tokens:
                break  # enough: the prompts left are the same kind (key order interleaves them)
    return DataResult(out, train_prompts=len(train), already_done=len(done), held_out=len(held),
                      written=written, tokens=n_tok, total_tokens=had + n_tok)

