"""The training loop: deterministic batches, AdamW + warmup/cosine, resume, data parallelism.

Every random choice is a function of (seed, step, global sample index): which sequences form the
global batch of a step, and which anchors each sequence gets (:mod:`dspark.training.batches`). So
a run killed and resumed from its last checkpoint replays exactly the same batches, and R
data-parallel ranks (``torchrun``, gloo on CPU) that each take 1/R of every global batch compute the same gradients as one process. The
forward and the loss are the drafter kind's (its ``DrafterKind.training_recipe()``); with
``TrainConfig.compile`` they run through ``torch.compile`` (:mod:`dspark.training.compiled`).

Loss normalisation is the reference's (DeepSpec): each loss term is num / (den + 1e-6) with
num = Σ w·ℓ and den = Σ w summed over every supervised token of the global batch
(``losses``). Each micro-batch backpropagates its own Σ λ·num; after the last one the ranks
all-reduce den (with the statistics) and the gradients are scaled by R / (den + 1e-6) (R undoes
DDP's average). Unlike DeepSpec — whose den is summed over ranks but not over gradient-accumulation
micro-steps — the result does not depend on how the global batch is split.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import field, frozen, validators

from dspark.training.batches import build_batch, global_batch
from dspark.training.forward import Batch
from dspark.training.losses import DEN_EPS, analytic_tau

__all__ = ["TrainConfig", "TrainData", "Trainer", "lr_at"]


def _pos(_i: Any, a: Any, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"TrainConfig.{a.name} must be positive, got {v!r}")


def _nonneg(_i: Any, a: Any, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"TrainConfig.{a.name} must be >= 0, got {v!r}")


def _bool(_i: Any, a: Any, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"TrainConfig.{a.name} must be True or False, got {v!r}")


@frozen
class TrainConfig:
    """Optimisation settings (the architecture lives in the drafter's ``DrafterConfig``)."""

    steps: int = field(default=1000, validator=_pos)
    seqs_per_step: int = field(default=8, validator=_pos)  # the global batch, over all ranks
    anchors_per_seq: int = field(default=32, validator=_pos)
    grad_accum: int = field(default=1, validator=_pos)
    lr: float = field(default=6e-4, validator=_pos)
    weight_decay: float = field(default=0.0, validator=_nonneg)
    warmup_frac: float = field(default=0.04, validator=_nonneg)
    min_lr_frac: float = field(default=0.1, validator=_nonneg)
    grad_clip: float = field(default=1.0, validator=_nonneg)
    dtype: str = field(default="float32", validator=validators.in_(("float32", "bfloat16")))
    lambda_ce: float = field(default=0.1, validator=_nonneg)
    lambda_l1: float = field(default=0.9, validator=_nonneg)
    lambda_conf: float = field(default=1.0, validator=_nonneg)
    lambda_soft_ce: float = field(default=0.0, validator=_nonneg)
    decay: float = field(default=4.0, validator=_pos)  # block position weights exp(−j / decay)
    step_decay: float = field(default=0.8, validator=_pos)  # Eagle3 step weights step_decay^k
    seed: int = field(default=0)
    checkpoint_every: int = field(default=100, validator=_pos)
    compile: bool = field(default=False, validator=_bool)  # the objective through torch.compile (compiled.py)

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> TrainConfig:
        """The reference's loss per drafter kind (DeepSpec configs): DSpark 0.1·CE + 0.9·L1 +
        1.0·confidence BCE; DFlash 1.0·CE; Eagle3 full-vocabulary soft CE, steps weighted 0.8^k."""
        from dspark.drafters.kinds import drafter_kind

        return cls(**{**drafter_kind(kind).loss_weights, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over W = max(1, warmup_frac·steps) steps, then cosine to min_lr_frac·lr.

    After warmup this is transformers' ``get_cosine_with_min_lr_schedule_with_warmup``; during
    warmup it is that schedule one step ahead (step s trains at lr·(s + 1)/W, not lr·s/W), so no
    batch is spent at lr 0 (tests/test_lr_schedule.py).
    """
    warm = max(1, int(round(cfg.warmup_frac * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class TrainData:
    """Training sequences (ids + where the response starts) and where their teacher comes from:
    a :class:`~dspark.training.teacher.FeatureCache` or an online target model. ``teacher``
    (online only; a cache knows its own): "full" — the target's final-normed last hidden state,
    the full-vocabulary teacher of the reference — or "topk" (``top_k`` most likely tokens)."""

    def __init__(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], *,
                 cache: Any = None, model: Any = None, teacher: str = "full", top_k: int = 32) -> None:
        if len(sequences) != len(prompt_lens) or not sequences:
            raise ValueError("need one prompt length per sequence, and at least one sequence")
        if (cache is None) == (model is None):
            raise ValueError("give exactly one teacher source: cache= (FeatureCache) or model= (online)")
        for i, (s, p) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= p < len(s):
                raise ValueError(f"sequence {i}: prompt length {p} leaves no response in {len(s)} tokens")
        if cache is not None and len(cache) != len(sequences):
            raise ValueError(f"feature cache has {len(cache)} sequences, the data {len(sequences)}")
        self.sequences = [list(s) for s in sequences]
        self.prompt_lens = list(prompt_lens)
        self.cache, self.model = cache, model
        from dspark.training.teacher import TEACHERS

        if cache is None and teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
        self.teacher: str = cache.teacher if cache is not None else teacher
        self.top_k: int | None = cache.top_k if cache is not None else (top_k if teacher == "topk" else None)

    def __len__(self) -> int:
        return len(self.sequences)

    def teacher_rows(self, idx: Sequence[int], layer_ids: Sequence[int]) -> list[Any]:
        """One :class:`~dspark.training.teacher.TeacherRow` per sequence index."""
        if self.cache is not None:
            return [self.cache.get(i, layer_ids) for i in idx]
        from dspark.training.teacher import teacher_forward

        return teacher_forward(self.model, [self.sequences[i] for i in idx], layer_ids, self.top_k,
                               teacher=self.teacher)


class _Objective(torch.nn.Module):
    """The drafter + its training forward and loss, one module so DDP can wrap it.

    ``forward(batch)`` → (Σ λ·num to backpropagate, detached {term: num}, den, per-position
    α sums [γ] and supervised counts [γ]) for one micro-batch."""

    def __init__(self, drafter: Any, cfg: TrainConfig) -> None:
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg
        from dspark.drafters.kinds import drafter_kind

        self.fwd, self.loss = drafter_kind(drafter.config.kind).training_recipe()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor,
                                             torch.Tensor, torch.Tensor]:
        c = self.cfg
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.dtype == "bfloat16"):
            t = self.fwd(self.drafter, batch)
        total, nums, den, per = self.loss.terms(c, t)
        vf = t.valid.float()
        return total, nums, den.detach().float(), (per["alpha"] * vf).sum(0), vf.sum(0)

    def lambdas(self) -> dict[str, float]:
        return self.loss.lambdas(self.cfg)


class Trainer:
    """Train ``drafter`` on ``data``; checkpoints in ``out_dir`` (``state.pt``, ``log.jsonl``)."""

    def __init__(self, drafter: Any, data: TrainData, cfg: TrainConfig, out_dir: str | Path,
                 *, rank: int = 0, world: int = 1, progress: bool = True) -> None:
        if cfg.seqs_per_step % (world * cfg.grad_accum):
            raise ValueError(f"seqs_per_step {cfg.seqs_per_step} must be divisible by ranks × grad_accum "
                             f"= {world} × {cfg.grad_accum}")
        self.drafter, self.data, self.cfg = drafter, data, cfg
        self.out = Path(out_dir)
        self.rank, self.world, self.progress = rank, world, progress and rank == 0
        self.objective = _Objective(drafter, cfg)
        self.compiled: Any = None  # a CompiledObjective with cfg.compile (inside DDP, which wraps it)
        if cfg.compile:
            from dspark.training.compiled import CompiledObjective

            self.compiled = CompiledObjective(self.objective, next(drafter.parameters()).device)
        self.model: Any = self.objective if self.compiled is None else self.compiled
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.model)
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step = 0
        self.log: list[dict[str, Any]] = []
        self._stop = False

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.out / "state.pt"

    def save_state(self) -> None:
        if self.rank:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"step": self.step, "model": self.drafter.state_dict(), "optim": self.opt.state_dict(),
                    "log": self.log, "config": self.cfg.to_dict(),
                    "drafter_config": self.drafter.config.to_dict()}, tmp)
        os.replace(tmp, self.state_path)  # atomic: an interrupted save never corrupts the last one

    def resume(self) -> bool:
        """Load ``state.pt`` if present; False when starting fresh."""
        if not self.state_path.is_file():
            return False
        try:
            # weights_only: tensors and plain containers only. Nothing is unpickled, so a planted
            # state.pt cannot run code; what this trainer writes loads this way.
            st = torch.load(self.state_path, map_location="cpu", weights_only=True)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{self.state_path} is corrupt or not a dspark training state (it holds more "
                             f"than tensors and plain values: {first}); move it away to start over") from None
        if not isinstance(st, dict):
            raise ValueError(f"{self.state_path} is not a dspark training state; move it away to start over")
        if st.get("drafter_config") != self.drafter.config.to_dict():
            raise ValueError(f"{self.state_path} was written for another drafter config; use another --out")
        config = st.get("config") if isinstance(st.get("config"), dict) else {}
        if config.get("seed") != self.cfg.seed:
            raise ValueError(f"{self.state_path} used seed {config.get('seed')}, not {self.cfg.seed}")
        bad = self._state_problem(st)
        if bad:
            raise ValueError(f"{self.state_path} is not a usable dspark training state ({bad}); move it away "
                             "to start over")
        self.drafter.load_state_dict(st["model"])
        try:
            self.opt.load_state_dict(st["optim"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{self.state_path}: its optimizer state does not fit this drafter "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); move it away "
                             "to start over") from None
        self.step, self.log = int(st["step"]), list(st["log"])
        return True

    def _state_problem(self, st: dict[str, Any]) -> str | None:
        """What makes a loaded state unusable, in a few words (None: nothing), checked before any
        of it is applied so a bad file changes nothing."""
        for key in ("model", "optim", "step", "log"):
            if key not in st:
                return f"no {key!r} entry"
        model, own = st["model"], self.drafter.state_dict()
        if not isinstance(model, dict):
            return "its 'model' entry is not a state dict"
        if set(model) != set(own):
            missing, extra = sorted(set(own) - set(model)), sorted(set(model) - set(own))
            return f"weights missing {missing[:3]} / unexpected {extra[:3]}"
        for k, v in model.items():
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(own[k].shape):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                return f"{k} has shape {got}, this drafter needs {tuple(own[k].shape)}"
        step = st["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return f"step {step!r} is not a non-negative integer"
        if not isinstance(st["log"], list):
            return "its 'log' entry is not a list"
        return None

    # -- the loop ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, G = self.cfg, self.cfg.seqs_per_step
        glob = global_batch(cfg, self.step, len(self.data))
        per_rank = G // self.world
        mine = list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        micro = per_rank // cfg.grad_accum
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, self.step)
        self.opt.zero_grad(set_to_none=True)
        nums: dict[str, torch.Tensor] = {}
        den = alpha_sum = count = 0
        for m in range(cfg.grad_accum):
            slots = mine[m * micro : (m + 1) * micro]
            batch = build_batch(self.data, self.cfg, self.step, [glob[s] for s in slots], slots,
                                self.drafter.target_layer_ids)
            if self.compiled is not None and not self.compiled.tried:  # compiles, or turns eager
                self.compiled.trial(batch, list(self.drafter.parameters()))
            sync = m == cfg.grad_accum - 1 or self.world == 1
            ctx = self.model.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                total, part, d, a_sum, cnt = self.model(batch)
                total.backward()  # Σ λ·num; scaled by R / (global den + 1e-6) below
            for key, v in part.items():
                nums[key] = nums.get(key, 0) + v
            den, alpha_sum, count = den + d, alpha_sum + a_sum, count + cnt
        # one flat tensor [nums…, den, α sums [γ], counts [γ]], summed over ranks in one all-reduce
        names = list(nums)
        flat = torch.cat([torch.stack([nums[k] for k in names]), torch.as_tensor(den, dtype=torch.float32)[None],
                          alpha_sum, count])
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
        den_g = float(flat[len(names)])
        scale = self.world / (den_g + DEN_EPS)  # DDP averaged the gradients over the R ranks
        for prm in self.drafter.parameters():
            if prm.grad is not None:
                prm.grad.mul_(scale)
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        self.opt.step()
        alpha_sum, count = flat[len(names) + 1 :].split(self.drafter.gamma)
        alpha = (alpha_sum / count.clamp_min(1)).tolist()
        parts = {k: float(v) / (den_g + DEN_EPS) for k, v in zip(names, flat[: len(names)])}
        lam = self.objective.lambdas()
        rec = {"step": self.step, "loss": sum(lam.get(k, 0.0) * v for k, v in parts.items()), **parts,
               "den": den_g, "alpha": alpha, "tau": analytic_tau(alpha), "lr": lr_at(cfg, self.step),
               "grad_norm": float(gnorm) if gnorm is not None else None}
        self.step += 1
        self.log.append(rec)
        return rec

    def fit(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train to ``cfg.steps``, checkpointing every ``checkpoint_every`` steps and on Ctrl-C /
        SIGTERM (then return early; call again, or re-run with resume, to continue)."""
        from tqdm import tqdm

        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def stop(*_: Any) -> None:
            self._stop = True

        if self.rank == 0:
            for s in old:
                signal.signal(s, stop)
        done_before = self.log[-1].get("seconds", 0.0) if self.log else 0.0
        t0 = time.perf_counter()
        try:
            with tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.drafter.config.kind}",
                      disable=not self.progress) as bar:
                while self.step < self.cfg.steps:
                    rec = self.train_step()
                    rec["seconds"] = done_before + time.perf_counter() - t0  # cumulative over resumes
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau']:.2f}")
                    if on_step:
                        on_step(rec)
                    if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                        self.save_state()
                    if self._stop_requested():
                        self.save_state()
                        break
        finally:
            if self.rank == 0:
                for s, h in old.items():
                    signal.signal(s, h)
        return self.log

    def _stop_requested(self) -> bool:
        if self.world == 1:
            return self._stop
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self._stop else 0.0])
        dist.all_reduce(flag)
        return bool(flag.item())
