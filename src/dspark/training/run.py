"""``dspark train``: build a drafter for a target, train it on self-distilled data, save it.

Single process: ``dspark train --data data/smollm2 --kind dspark --out runs/dspark``.
Data parallel: ``torchrun --nproc-per-node 2 -m dspark train ...`` (gloo on CPU, NCCL on GPUs);
the result equals the single-process run with the same global batch (``--seqs-per-step``).
Re-running the same command resumes from ``OUT/state.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_for_target", "run_train", "load_training_sequences"]


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


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    return dist.get_rank(), world


def run_train(args: Any) -> int:
    rank, world = _dist()
    if world == 1:
        return _run_train(args, rank, world)
    import torch.distributed as dist

    # The group is torn down explicitly: a process exiting with a live gloo group can abort
    # ("terminate called without an active exception") and fail the whole torchrun job. On success
    # every rank first waits for rank 0's checkpoint; after an error no collective is attempted.
    try:
        rc = _run_train(args, rank, world)
        dist.barrier()
        return rc
    finally:
        dist.destroy_process_group()


def _run_train(args: Any, rank: int, world: int) -> int:
    from dspark.drafters.checkpoint import save_pretrained
    from dspark.drafters.kinds import drafter_kind
    from dspark.models import load_causal_lm
    from dspark.training.teacher import FeatureCache, build_feature_cache
    from dspark.training.trainer import TrainConfig, TrainData, Trainer

    drafter_kind(args.kind)  # an unknown kind fails here, before the data and the model load
    torch.manual_seed(args.seed)
    seqs, pls = load_training_sequences(args.data, args.max_seq_len)  # bad data fails before the model loads
    model, _ = load_causal_lm(args.model, torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    config: dict[str, Any] = {"gamma": args.gamma, "num_layers": args.num_layers}
    if drafter_kind(args.kind).config_defaults(model.config.num_hidden_layers, model.config.vocab_size).get("head"):
        config.update(head=args.head, rank=args.rank, confidence=True)  # a kind with a sequential head
    if args.draft_vocab:
        config["draft_vocab_size"] = args.draft_vocab + 1  # + the placeholder slot
    if args.layer_ids:
        config["layer_ids"] = tuple(args.layer_ids)
    drafter = build_for_target(model, args.kind, sequences=seqs, init=args.init,
                               target_name=args.model, **config)
    if args.features == "cache":
        teacher = getattr(args, "teacher", "full")
        cache_dir = Path(args.feature_cache or Path(args.data) / ("features-full" if teacher == "full" else "features"))
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
            bf16 = getattr(args, "teacher_dtype", "float32") == "bfloat16"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                cache = build_feature_cache(model, seqs, cache_dir, layers, top_k=args.top_k,
                                            progress=not args.quiet, teacher=teacher)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        cache = cache if cache is not None else FeatureCache(cache_dir)
        if cache.teacher != teacher:
            raise ValueError(f"{cache_dir} holds a {cache.teacher!r}-teacher cache, not {teacher!r}")
        data = TrainData(seqs, pls, cache=cache)
    else:
        data = TrainData(seqs, pls, model=model, teacher=getattr(args, "teacher", "full"), top_k=args.top_k)
    tc = TrainConfig.for_kind(
        args.kind, steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
        grad_accum=args.grad_accum, lr=args.lr, dtype=args.dtype, seed=args.seed,
        checkpoint_every=args.checkpoint_every)
    out = Path(args.out)
    trainer = Trainer(drafter, data, tc, out, rank=rank, world=world, progress=not args.quiet)
    if trainer.resume() and rank == 0:
        print(f"resuming {out} at step {trainer.step}/{tc.steps}", file=sys.stderr)
    t0 = time.perf_counter()
    log = trainer.fit()
    if rank == 0:
        (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        if trainer.step < tc.steps:
            print(f"stopped at step {trainer.step}/{tc.steps}; state saved to {trainer.state_path} — "
                  "re-run the same command to resume", file=sys.stderr)
            return 130
        ckpt = save_pretrained(drafter, out / "checkpoint", dtype=_save_dtype(args.save_dtype),
                               quantize=args.save_dtype == "int8")
        summary = {"kind": args.kind, "head": config.get("head"), "steps": tc.steps, "train": tc.to_dict(),
                   "teacher": data.teacher, "teacher_top_k": data.top_k,
                   "drafter": drafter.config.to_dict(), "sequences": len(seqs),
                   "tokens": sum(len(s) for s in seqs), "seconds_this_run": time.perf_counter() - t0,
                   "seconds_total": log[-1].get("seconds", 0.0) if log else 0.0, "world_size": world,
                   "threads": torch.get_num_threads(), "final": log[-1] if log else None,
                   "command": " ".join(sys.argv)}
        (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot_curve(log, out / "curve.png")
        print(f"saved {ckpt} (final loss {log[-1]['loss']:.3f}, analytic τ {log[-1]['tau']:.2f})", file=sys.stderr)
    return 0


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
