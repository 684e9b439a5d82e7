"""The training loop: deterministic batches, AdamW + warmup/cosine, resume, data parallelism.

Every random choice is a function of (seed, step, global sample index): which sequences form the
global batch of a step, and which anchors each sequence gets. So a run killed and resumed from its
last checkpoint replays exactly the same batches, and R data-parallel ranks (``torchrun``, gloo on
CPU) that each take 1/R of every global batch compute the same gradients as one process: losses
are sums divided by the global number of blocks (``losses.block_losses``), DDP averages the
gradients over ranks, and each rank's loss is scaled by R to undo the average.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import field, frozen, validators

from dspark.training.forward import Batch, block_forward, eagle3_forward
from dspark.training.losses import analytic_tau, block_losses

__all__ = ["TrainConfig", "TrainData", "Trainer", "lr_at"]


def _pos(_i: Any, a: Any, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"TrainConfig.{a.name} must be positive, got {v!r}")


def _nonneg(_i: Any, a: Any, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"TrainConfig.{a.name} must be >= 0, got {v!r}")


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
    decay: float = field(default=4.0, validator=_pos)
    seed: int = field(default=0)
    checkpoint_every: int = field(default=100, validator=_pos)

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> TrainConfig:
        """The paper's loss per drafter kind: DSpark CE + L1 + confidence BCE; DFlash CE;
        Eagle3 soft-label CE over its unrolled steps."""
        losses = {"dspark": {}, "dflash": {"lambda_ce": 1.0, "lambda_l1": 0.0, "lambda_conf": 0.0},
                  "eagle3": {"lambda_ce": 0.0, "lambda_l1": 0.0, "lambda_conf": 0.0, "lambda_soft_ce": 1.0}}
        if kind not in losses:
            raise ValueError(f"unknown drafter kind {kind!r}")
        return cls(**{**losses[kind], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_frac·steps, then cosine to min_lr_frac·lr."""
    warm = max(1, int(round(cfg.warmup_frac * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class TrainData:
    """Training sequences (ids + where the response starts) and where their teacher comes from:
    a :class:`~dspark.training.teacher.FeatureCache` or an online target model."""

    def __init__(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], *,
                 cache: Any = None, model: Any = None, top_k: int = 32) -> None:
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
        self.top_k = cache.top_k if cache is not None else top_k

    def __len__(self) -> int:
        return len(self.sequences)

    def teacher(self, idx: Sequence[int], layer_ids: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        if self.cache is not None:
            return [self.cache.get(i, layer_ids) for i in idx]
        from dspark.training.teacher import teacher_forward

        return teacher_forward(self.model, [self.sequences[i] for i in idx], layer_ids, self.top_k)


@functools.lru_cache(maxsize=4)
def _step_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def global_batch(cfg: TrainConfig, step: int, n: int) -> list[int]:
    """Sequence indices of the global batch at ``step`` (epochs are seeded permutations)."""
    G = cfg.seqs_per_step
    out = []
    for j in range(step * G, (step + 1) * G):
        epoch, k = divmod(j, n)
        out.append(int(_step_order(cfg.seed, epoch, n)[k]))
    return out


def sample_anchors(cfg: TrainConfig, step: int, slot: int, length: int, prompt_len: int) -> list[int]:
    """Up to N distinct anchors in [prompt_len − 1, length − 2] for global batch slot ``slot``."""
    lo, hi = prompt_len - 1, length - 2
    cand = hi - lo + 1
    if cand <= 0:
        return []
    g = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{step}/{slot}".encode()))
    pick = torch.randperm(cand, generator=g)[: cfg.anchors_per_seq] + lo
    return sorted(pick.tolist())


class _Objective(torch.nn.Module):
    """The drafter + its training forward and loss, one module so DDP can wrap it."""

    def __init__(self, drafter: Any, cfg: TrainConfig) -> None:
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg
        self.fwd = eagle3_forward if drafter.config.kind == "eagle3" else block_forward

    def forward(self, batch: Batch, norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.cfg
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.dtype == "bfloat16"):
            t = self.fwd(self.drafter, batch)
        return block_losses(t.logq.float(), t.label, t.p_slots, t.p_top, t.valid, t.conf_logits, norm=norm,
                            lambda_ce=c.lambda_ce, lambda_l1=c.lambda_l1, lambda_conf=c.lambda_conf,
                            lambda_soft_ce=c.lambda_soft_ce, decay=c.decay)


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
        self.model: Any = self.objective
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.objective)
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
            st = torch.load(self.state_path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ValueError(f"{self.state_path} is corrupt ({exc}); move it away to start over") from None
        if st.get("drafter_config") != self.drafter.config.to_dict():
            raise ValueError(f"{self.state_path} was written for another drafter config; use another --out")
        if st.get("config", {}).get("seed") != self.cfg.seed:
            raise ValueError(f"{self.state_path} used seed {st['config'].get('seed')}, not {self.cfg.seed}")
        self.drafter.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optim"])
        self.step, self.log = int(st["step"]), list(st["log"])
        return True

    # -- batches ----------------------------------------------------------------------------
    def _batch(self, idx: list[int], slots: list[int]) -> Batch:
        d = self.data
        layer_ids = self.drafter.target_layer_ids
        teach = d.teacher(idx, layer_ids)
        n = max(len(d.sequences[i]) for i in idx)
        S, k = len(idx), d.top_k
        ids = torch.zeros(S, n, dtype=torch.long)
        feats = torch.zeros(S, n, teach[0][0].shape[1])
        top_ids = torch.zeros(S, n, k, dtype=torch.long)
        top_logp = torch.full((S, n, k), -30.0)
        anchors = torch.full((S, self.cfg.anchors_per_seq), -1, dtype=torch.long)
        for r, (i, slot, (f, ti, tl)) in enumerate(zip(idx, slots, teach)):
            L = len(d.sequences[i])
            ids[r, :L] = torch.tensor(d.sequences[i])
            feats[r, :L], top_ids[r, :L], top_logp[r, :L] = f, ti, tl
            a = sample_anchors(self.cfg, self.step, slot, L, d.prompt_lens[i])
            anchors[r, : len(a)] = torch.tensor(a, dtype=torch.long)
        return Batch(ids, torch.tensor([len(d.sequences[i]) for i in idx]),
                     torch.tensor([d.prompt_lens[i] for i in idx]), feats, top_ids, top_logp, anchors)

    # -- the loop ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, G = self.cfg, self.cfg.seqs_per_step
        glob = global_batch(cfg, self.step, len(self.data))
        per_rank = G // self.world
        mine = list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        micro = per_rank // cfg.grad_accum
        norm = float(G * cfg.anchors_per_seq)  # blocks (Eagle3: chains) in the global batch
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, self.step)
        self.opt.zero_grad(set_to_none=True)
        totals: dict[str, Any] = {}
        for m in range(cfg.grad_accum):
            slots = mine[m * micro : (m + 1) * micro]
            batch = self._batch([glob[s] for s in slots], slots)
            sync = m == cfg.grad_accum - 1 or self.world == 1
            ctx = self.model.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                loss, stats = self.model(batch, norm)
                (loss * self.world).backward()
            for key, v in stats.items():
                totals[key] = totals.get(key, 0) + v
        # one flat tensor [loss terms…, α sums [γ], counts [γ]], summed over ranks in one all-reduce
        names = [k for k in ("ce", "l1", "soft_ce", "conf") if k in totals]
        flat = torch.cat([torch.stack([totals[k] for k in names]), totals["alpha_sum"], totals["count"]])
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        self.opt.step()
        alpha_sum, count = flat[len(names):].split(self.drafter.gamma)
        alpha = (alpha_sum / count.clamp_min(1)).tolist()
        parts = {k: float(v) for k, v in zip(names, flat[: len(names)])}
        rec = {"step": self.step, "loss": sum(parts.values()), **parts, "alpha": alpha,
               "tau": analytic_tau(alpha), "lr": lr_at(cfg, self.step),
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
