"""``dspark train``: build a drafter for a target, train it on self-distilled data, save it.

Single process: ``dspark train --data data/smollm2 --kind dspark --out runs/dspark``.
Data parallel: ``torchrun --nproc-per-node 2 -m dspark train ...`` (gloo on CPU, NCCL on GPUs);
the result equals the single-process run with the same global batch (``--seqs-per-step``).
Re-running the same command resumes from ``OUT/state.pt``.

The library function is :func:`train` (a :class:`TrainOptions` in, a :class:`TrainResult` out).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from dspark.options import (
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    option,
    optional_ints,
    optional_path,
    path,
    resolve_options,
)

__all__ = ["TrainOptions", "TrainResult", "build_for_target", "load_training_sequences", "train"]

FLOAT_DTYPES = ("float32", "bfloat16")


def _gamma(_inst: Any, a: Any, v: Any) -> None:
    from dspark.drafters.config import MAX_GAMMA

    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_GAMMA:
        raise ValueError(f"{a.name} must be an integer in 1..{MAX_GAMMA}, got {v!r}")


def _layer_ids(_inst: Any, a: Any, v: tuple[int, ...] | None) -> None:
    if v is not None and (not v or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in v)):
        raise ValueError(f"{a.name} must be non-negative target layer ids, got {v!r}")


@frozen
class TrainOptions(NamespaceOptions):
    """What ``dspark train`` trains: each field is an option of the command
    (:func:`dspark.options.option`). ``data`` (a ``dspark data`` folder) and ``out`` (the run
    folder) have no default."""

    data: str = option(converter=path, help="a `dspark data` folder (train.jsonl)")
    out: str = option(converter=path, help="run folder: state.pt, log.jsonl, curve.png, checkpoint/")
    kind: str = option("dspark", help="drafter kind: dspark, dflash, eagle3, eagle3-fused, or one a plugin registers")
    head: str = option("gated-markov", choices=("vanilla-markov", "gated-markov", "rnn"),
                       help="the sequential head that conditions each draft position on the previous ones")
    rank: int = option(256, validator=at_least(1), help="sequential head rank r")
    num_layers: int = option(1, validator=at_least(1), help="draft layers (Eagle3: always 1)")
    gamma: int = option(7, validator=_gamma, help="block size γ")
    draft_vocab: int = option(0, validator=at_least(0), help="reduced draft vocabulary size (0: the target's)")
    layer_ids: tuple[int, ...] | None = option(None, converter=optional_ints, validator=_layer_ids,
                                               help="comma-separated target layer ids (default: evenly spread)")
    init: str = option("target", choices=("target", "random"),
                       help="copy the target's top layers into the draft layers, or random init")
    init_from: str | None = option(None, converter=optional_path, metavar="CHECKPOINT",
                                   help="start from a trained drafter (dspark, DeepSpec, speculators or z-lab DFlash "
                                   "checkpoint folder) with a fresh optimizer: its config replaces --kind/--head/--rank/"
                                   "--num-layers/--gamma/--draft-vocab/--layer-ids/--init")
    steps: int = option(1000, validator=at_least(1), help="optimizer steps")
    seqs_per_step: int = option(8, validator=at_least(1), help="global batch (sequences) per step")
    anchors: int = option(32, validator=at_least(1), help="anchor blocks per sequence")
    grad_accum: int = option(1, validator=at_least(1), help="micro-batches accumulated per step")
    lr: float = option(6e-4, validator=at_least(0, integer=False, strict=True), help="peak learning rate")
    dtype: str = option("float32", choices=FLOAT_DTYPES, help="autocast dtype")
    compile: bool = option(False, help="run the training forward and backward through torch.compile (compiled at the "
                           "first step; eager, said in one line, where it cannot compile)")
    features: str = option("cache", choices=("cache", "online"),
                           help="teacher features from an on-disk cache (built on first use) or online")
    feature_cache: str | None = option(None, converter=optional_path,
                                       help="cache folder (default DATA/features-full, or DATA/features for --teacher topk)")
    teacher_dtype: str = option("float32", choices=FLOAT_DTYPES,
                                help="precision of the target's forward that builds the feature cache")
    teacher: str = option("full", choices=("full", "topk"),
                          help="full: the target's full-vocabulary distribution (the reference; the step applies the "
                          "LM head to the cached final hidden state); topk: only its --top-k most likely tokens "
                          "(L1 / acceptance rate biased)")
    top_k: int = option(32, validator=at_least(1), help="k of the top-k teacher (--teacher topk)")
    max_seq_len: int = option(512, validator=at_least(0), help="longest training sequence in tokens (0: no limit)")
    checkpoint_every: int = option(50, validator=at_least(1), help="steps between saves of OUT/state.pt")
    save_dtype: str = option("int8", choices=("float32", "float16", "bfloat16", "int8"),
                             help="dtype of the saved checkpoint's weights")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    seed: int = option(0, help="random seed")
    quiet: bool = False  # the global -q


@frozen
class TrainResult:
    """What :func:`train` did: the run folder, the step reached (of ``steps``), the loss log, the
    saved checkpoint and the ``train.json`` summary (both ``None`` on ranks other than 0 and when
    training stopped early, on SIGINT / SIGTERM)."""

    out: Path
    step: int
    steps: int
    checkpoint: Path | None
    log: list[dict[str, Any]]
    summary: dict[str, Any] | None
    rank: int = 0

    @property
    def finished(self) -> bool:
        """Every step trained (False: stopped early; the same call resumes from :attr:`state_path`)."""
        return self.step >= self.steps

    @property
    def state_path(self) -> Path:
        return self.out / "state.pt"


def build_for_target(model: Any, kind: str, *, sequences: Any = None, init: str = "target",
                     target_name: str = "target", **config: Any) -> Any:
    """A fresh drafter of ``kind`` for an HF ``model``: draft vocabulary from ``sequences`` when
    ``draft_vocab_size`` is set, bound to the target's embedding / LM head, initialised from the
    target's top layers (``init="target"``) or randomly."""
    from dspark.drafters.config import DrafterConfig
    from dspark.drafters.neural import build_drafter
    from dspark.training.init import choose_draft_vocab, init_from_target

    dc = DrafterConfig.for_target(model.config, kind, target_name=target_name, **config)
    drafter = build_drafter(dc)
    if dc.draft_vocab_size is not None:
        if sequences is None:
            raise ValueError("a reduced draft vocabulary is chosen from the training sequences; pass sequences=")
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        always = [eos] if isinstance(eos, int) else list(eos or [])
        drafter.set_draft_vocab(choose_draft_vocab(sequences, dc.draft_vocab_size - 1, always))
    drafter.bind_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    if init == "target":
        init_from_target(drafter, model)
    elif init != "random":
        raise ValueError(f"init must be 'target' or 'random', got {init!r}")
    return drafter


def load_training_sequences(path: str | Path, max_len: int | None = None) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) from a ``dspark data`` folder or train.jsonl file."""
    from dspark.data.selfdistill import read_records

    p = Path(path)
    recs = read_records(p / "train.jsonl" if p.is_dir() else p)
    seqs, pls = [], []
    for r in recs:
        ids = r.ids[:max_len] if max_len else r.ids
        if len(r.response_ids) >= 2 and len(r.prompt_ids) < len(ids):
            seqs.append(ids)
            pls.append(len(r.prompt_ids))
    if not seqs:
        raise ValueError(f"{path}: no usable training sequences (each needs a response of ≥ 2 tokens)")
    return seqs, pls


def load_for_training(model: Any, path: str | Path, target_name: str = "target") -> Any:
    """A trained drafter checkpoint (any readable format) checked against and bound to the HF
    ``model``, as float32 trainable weights (an int8 checkpoint dequantized): where ``--init-from``
    starts. The drafter's config is the checkpoint's."""
    from types import SimpleNamespace

    from dspark.drafters.checkpoint import from_pretrained

    c = model.config
    target = SimpleNamespace(model=model, name=target_name, vocab_size=c.vocab_size,
                             hidden_size=c.hidden_size, num_layers=c.num_hidden_layers)
    drafter = from_pretrained(path, target).float().train()
    for p in drafter.parameters():
        p.requires_grad_(True)
    return drafter


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    return dist.get_rank(), world


def train(options: TrainOptions | None = None, /, **overrides: Any) -> TrainResult:
    """Build a drafter of ``options.kind`` for the target, train it on a ``dspark data`` folder
    and save it to ``out/checkpoint`` (with ``train.json``, ``log.jsonl``, ``curve.png``); a re-run
    resumes from ``out/state.pt``. Under ``torchrun`` every rank calls this (data parallel).
    ``overrides`` replace fields of ``options`` (or give all of them: ``data=``, ``out=``, ...)."""
    opts = resolve_options(TrainOptions, options, overrides)
    rank, world = _dist()
    if world == 1:
        return _train(opts, rank, world)
    import torch.distributed as dist

    # The group is torn down explicitly: a process exiting with a live gloo group can abort
    # ("terminate called without an active exception") and fail the whole torchrun job. On success
    # every rank first waits for rank 0's checkpoint; after an error no collective is attempted.
    try:
        result = _train(opts, rank, world)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _train(opts: TrainOptions, rank: int, world: int) -> TrainResult:
    from dspark.drafters.checkpoint import save_pretrained
    from dspark.drafters.kinds import drafter_kind
    from dspark.models import load_causal_lm
    from dspark.training.teacher import FeatureCache, build_feature_cache
    from dspark.training.trainer import TrainConfig, TrainData, Trainer

    drafter_kind(opts.kind)  # an unknown kind fails here, before the data and the model load
    torch.manual_seed(opts.seed)
    seqs, pls = load_training_sequences(opts.data, opts.max_seq_len)  # bad data fails before the model loads
    model, _ = load_causal_lm(opts.model, torch.float32)
    vocab = int(model.config.vocab_size)
    if any(t >= vocab for s in seqs for t in s):  # ids another target wrote: named by file and line
        from dspark.data.selfdistill import read_records

        p = Path(opts.data)
        read_records(p / "train.jsonl" if p.is_dir() else p, vocab_size=vocab)
    for p in model.parameters():
        p.requires_grad_(False)
    config: dict[str, Any] = {"gamma": opts.gamma, "num_layers": opts.num_layers}
    if drafter_kind(opts.kind).config_defaults(model.config.num_hidden_layers, model.config.vocab_size).get("head"):
        config.update(head=opts.head, rank=opts.rank, confidence=True)  # a kind with a sequential head
    if opts.draft_vocab:
        config["draft_vocab_size"] = opts.draft_vocab + 1  # + the placeholder slot
    if opts.layer_ids:
        config["layer_ids"] = tuple(opts.layer_ids)
    if opts.init_from:
        drafter = load_for_training(model, opts.init_from, target_name=opts.model)
        if rank == 0:
            print(f"starting from {opts.init_from} ({drafter.config.kind}, {drafter.config.num_layers} layer(s)); "
                  "its config replaces the drafter options", file=sys.stderr)
    else:
        drafter = build_for_target(model, opts.kind, sequences=seqs, init=opts.init,
                                   target_name=opts.model, **config)
    kind = drafter.config.kind
    if opts.features == "cache":
        teacher = opts.teacher
        cache_dir = Path(opts.feature_cache or Path(opts.data) / ("features-full" if teacher == "full" else "features"))
        cache = None
        if rank == 0:
            from dspark.drafters.config import default_layer_ids

            # cache the default 5 layers too: Eagle3's low/mid/high are a subset, so every drafter
            # kind trains from one cache. Building resumes at the first missing shard, is a no-op
            # for a complete cache, and refuses a cache of other data or settings.
            L = model.config.num_hidden_layers
            layers = sorted(set(default_layer_ids(L, min(5, L - 1))) | set(drafter.target_layer_ids))
            # --teacher-dtype bfloat16: the teacher forward under bf16 autocast (2-3x faster on CPUs with
            # AVX-512-BF16; features then carry bf16 rounding, as a bf16 target's do at inference)
            bf16 = opts.teacher_dtype == "bfloat16"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                cache = build_feature_cache(model, seqs, cache_dir, layers, top_k=opts.top_k,
                                            progress=not opts.quiet, teacher=teacher)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        cache = cache if cache is not None else FeatureCache(cache_dir)
        if cache.teacher != teacher:
            raise ValueError(f"{cache_dir} holds a {cache.teacher!r}-teacher cache, not {teacher!r}")
        data = TrainData(seqs, pls, cache=cache)
    else:
        data = TrainData(seqs, pls, model=model, teacher=opts.teacher, top_k=opts.top_k)
    tc = TrainConfig.for_kind(
        kind, steps=opts.steps, seqs_per_step=opts.seqs_per_step, anchors_per_seq=opts.anchors,
        grad_accum=opts.grad_accum, lr=opts.lr, dtype=opts.dtype, seed=opts.seed,
        checkpoint_every=opts.checkpoint_every, compile=opts.compile)
    out = Path(opts.out)
    trainer = Trainer(drafter, data, tc, out, rank=rank, world=world, progress=not opts.quiet)
    if trainer.resume() and rank == 0:
        print(f"resuming {out} at step {trainer.step}/{tc.steps}", file=sys.stderr)
    t0 = time.perf_counter()
    log = trainer.fit()
    ckpt, summary = None, None
    if rank == 0:
        (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    if rank == 0 and trainer.step >= tc.steps:
        ckpt = save_pretrained(drafter, out / "checkpoint", dtype=_save_dtype(opts.save_dtype),
                               quantize=opts.save_dtype == "int8")
        summary = {"kind": kind, "head": drafter.config.head, "init_from": opts.init_from, "steps": tc.steps, "train": tc.to_dict(),
                   "teacher": data.teacher, "teacher_top_k": data.top_k,
                   "drafter": drafter.config.to_dict(), "sequences": len(seqs),
                   "tokens": sum(len(s) for s in seqs), "seconds_this_run": time.perf_counter() - t0,
                   "seconds_total": log[-1].get("seconds", 0.0) if log else 0.0, "world_size": world,
                   "threads": torch.get_num_threads(), "final": log[-1] if log else None,
                   "command": " ".join(sys.argv)}
        (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot_curve(log, out / "curve.png")
    return TrainResult(out, trainer.step, tc.steps, ckpt, log, summary, rank)


def _save_dtype(name: str) -> torch.dtype | None:
    return {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.float16}[name]


def _plot_curve(log: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is optional (the plot extra)
        return
    steps = [r["step"] for r in log]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(steps, [r["loss"] for r in log], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("loss")
    b.plot(steps, [r["tau"] for r in log], lw=0.8, color="C1")
    b.set_xlabel("step")
    b.set_ylabel("analytic τ (teacher-forced)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
