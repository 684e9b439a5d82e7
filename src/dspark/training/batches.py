"""The trainer's batches: which sequences form the global batch of a step, which anchors each
sequence gets, and the padded :class:`~dspark.training.forward.Batch` of a micro-batch.

Every random choice is a function of (seed, step, global sample index), so a run resumed from its
last checkpoint replays exactly the same batches and data-parallel ranks split them without
talking to each other (:mod:`dspark.training.trainer`). ``cfg`` below is a
:class:`~dspark.training.trainer.TrainConfig`, ``data`` a :class:`~dspark.training.trainer.TrainData`.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from dspark.training.forward import Batch

__all__ = ["global_batch", "anchor_candidates", "sample_anchors", "build_batch"]


@functools.lru_cache(maxsize=4)
def _step_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def global_batch(cfg: Any, step: int, n: int) -> list[int]:
    """Sequence indices of the global batch at ``step`` (epochs are seeded permutations)."""
    G = cfg.seqs_per_step
    out = []
    for j in range(step * G, (step + 1) * G):
        epoch, k = divmod(j, n)
        out.append(int(_step_order(cfg.seed, epoch, n)[k]))
    return out


def anchor_candidates(length: int, prompt_len: int, loss_mask: Sequence[float] | None = None) -> list[int]:
    """Positions a the reference may anchor a block at: loss_mask[a] = loss_mask[a+1] = 1,
    a ≤ length − 2 (the anchor and the first label inside the supervised response). The default
    loss mask is the response, positions prompt_len … length − 1: candidates prompt_len … length − 2."""
    if loss_mask is None:
        return list(range(prompt_len, length - 1))
    return [a for a in range(min(length, len(loss_mask)) - 1) if loss_mask[a] > 0.5 and loss_mask[a + 1] > 0.5]


def sample_anchors(cfg: Any, step: int, slot: int, length: int, prompt_len: int,
                   loss_mask: Sequence[float] | None = None) -> list[int]:
    """Up to N distinct anchors among :func:`anchor_candidates`, drawn without replacement and
    sorted; deterministic in (seed, step, global batch slot)."""
    cand = anchor_candidates(length, prompt_len, loss_mask)
    if not cand:
        return []
    g = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{step}/{slot}".encode()))
    pick = torch.randperm(len(cand), generator=g)[: cfg.anchors_per_seq]
    return sorted(cand[i] for i in pick.tolist())


def build_batch(data: Any, cfg: Any, step: int, idx: list[int], slots: list[int],
                layer_ids: Sequence[int]) -> Batch:
    """The padded batch of sequences ``idx`` (global batch slots ``slots``) at training ``step``:
    their ids, the target features at ``layer_ids``, their teacher and their anchors."""
    d = data
    teach = d.teacher_rows(idx, layer_ids)
    n = max(len(d.sequences[i]) for i in idx)
    S = len(idx)
    ids = torch.zeros(S, n, dtype=torch.long)
    feats = torch.zeros(S, n, teach[0].feats.shape[1])
    full = d.teacher == "full"
    if full:
        last = torch.zeros(S, n, teach[0].last_hidden.shape[1])
        with_lse = all(row.last_lse is not None for row in teach)
        lse = torch.zeros(S, n)
    else:
        k = teach[0].top_ids.shape[1]
        top_ids = torch.zeros(S, n, k, dtype=torch.long)
        top_logp = torch.full((S, n, k), -30.0)
    anchors = torch.full((S, cfg.anchors_per_seq), -1, dtype=torch.long)
    for r, (i, slot, row) in enumerate(zip(idx, slots, teach)):
        L = len(d.sequences[i])
        ids[r, :L] = torch.tensor(d.sequences[i])
        feats[r, :L] = row.feats
        if full:
            last[r, :L] = row.last_hidden
            if with_lse:
                lse[r, :L] = row.last_lse
        else:
            top_ids[r, :L], top_logp[r, :L] = row.top_ids, row.top_logp
        a = sample_anchors(cfg, step, slot, L, d.prompt_lens[i])
        anchors[r, : len(a)] = torch.tensor(a, dtype=torch.long)
    lengths = torch.tensor([len(d.sequences[i]) for i in idx])
    prompt_lens = torch.tensor([d.prompt_lens[i] for i in idx])
    if full:
        return Batch(ids, lengths, prompt_lens, feats, None, None, anchors, last_hidden=last,
                     last_lse=lse if with_lse else None)
    return Batch(ids, lengths, prompt_lens, feats, top_ids, top_logp, anchors)
