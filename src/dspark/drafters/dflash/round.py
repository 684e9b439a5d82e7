"""DFlash's drafting round, the one every block drafter runs (DSpark's adds its head steps,
:mod:`dspark.drafters.dspark.round`).

Terms as in :mod:`dspark.drafters.loop`. Per round the new context positions of all requests go
through one packed ``context`` call (KV injection is per position) into their caches; one
``backbone`` call over the padded caches gives h [R, γ, d] and base logits U [R, γ, V_d]; then
x̂_j is drawn for j = 1..γ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dspark.drafters.draws import Draws, feature_starts
from dspark.drafters.loop import DraftingLoop, KVStore
from dspark.drafters.vocab import to_slots
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["block_round", "draft_block", "backbone"]

#: builds a round's per-step logits refiner: (loop, context, dtype) → refiner (see :func:`draft_block`)
RefinerFactory = Callable[[DraftingLoop, DraftContext, torch.dtype], Any]


def block_round(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
    """DFlash: ingest new context, one parallel backbone call, x̂_j ~ softmax(U_j) for j = 1..γ."""
    return draft_block(loop, context, feats)


def draft_block(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor],
                refiner: RefinerFactory | None = None) -> DraftBlock:
    """A block drafter's round: ingest new context, one parallel backbone call, γ draws.

    ``refiner`` (a kind with per-step logits of its own, DSpark's sequential head) is built once
    per round as ``refiner(loop, context, dtype)`` and called at each step j as ``refiner(x̂_{j−1}
    slots [R], h_j [R, d], U_j [R, V_d]) → logits [R, V_d]`` before the draw; its
    ``confidence_logits()`` [R, γ] (or None) go into the block. A refiner may end the drafts early
    (DSpark's: the round's ``context.stop``, or the opt-in survival floor): its ``done`` turning
    true after step j leaves x̂_j on undrawn (:meth:`Draws.finish`), and its ``cut_lengths(valid)``
    gives the block's valid lengths.
    """
    s = loop.spec
    R = len(context.request_ids)
    loop.check_limit("backbone", "batch", R)
    caches, chunks, positions, owners = [], [], [], []
    for rid, f, start in zip(context.request_ids, feats, feature_starts(context)):
        cache = loop.cache_for(rid, start)
        caches.append(cache)
        if f.shape[0]:
            chunks.append(f)
            positions.append(torch.arange(cache.end, cache.end + f.shape[0]))
            owners.append((cache, f.shape[0]))
    t0 = time.perf_counter()
    if chunks:
        out = loop.run_packed(
            "context", {"features": torch.cat(chunks), "positions": torch.cat(positions)},
            {"features": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
        k, v, off = out["ctx_k"], out["ctx_v"], 0  # [L, H_kv, N, hd]
        for cache, n in owners:
            cache.append(k[:, :, off : off + n], v[:, :, off : off + n])
            off += n
    t_ingest = time.perf_counter() - t0
    for rid, ids, cache in zip(context.request_ids, context.token_ids, caches):
        loop.check_anchor(rid, cache, ids, lag=1)
    anchors = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R]
    t0 = time.perf_counter()
    h, U = backbone(loop, anchors, torch.tensor([ids.numel() - 1 for ids in context.token_ids]), caches)
    t_head = 0.0
    draws = Draws(loop, context)
    prev = to_slots(s.vocab_map, anchors)  # x̂_0 = the anchor, as a draft slot
    steps = refiner(loop, context, h.dtype) if refiner is not None else None
    for j in range(s.gamma):
        U_j = U[:, j].float()  # [R, V_d]
        if steps is not None:
            t1 = time.perf_counter()
            U_j = steps(prev, h[:, j], U_j)
            t_head += time.perf_counter() - t1
            if getattr(steps, "done", False):  # every request's draft ended before x̂_j
                break
        prev = draws.draw(U_j)
    tokens, q, logits = draws.finish(s.gamma)  # [R, γ], [R, γ, V], [R, γ, V]
    valid = loop.valid(context, R)
    if steps is not None and hasattr(steps, "cut_lengths"):
        valid = steps.cut_lengths(valid)
    loop.timings = {"draft": time.perf_counter() - t0, "sequential_head": t_head, "ingest": t_ingest}
    return DraftBlock(
        tokens=tokens, q=q, valid_lengths=valid,
        confidence_logits=steps.confidence_logits() if steps is not None else None,  # [R, γ]
        draft_logits=logits,
        hidden=h.cpu() if s.returns_hidden else None,  # [R, γ, d]
    )


def backbone(loop: DraftingLoop, anchors: torch.Tensor, anchor_pos: torch.Tensor,
             caches: list[KVStore]) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [R], anchor_pos [R] over the cached contexts → h [R, γ, d], base logits U [R, γ, V_d]."""
    s = loop.spec
    skip = 0 if s.sample_from_anchor else 1  # z-lab DFlash: the anchor row predicts nothing
    ctx_k, ctx_v, mask = loop.gather(caches)
    loop.check_limit("backbone", "past", mask.shape[1])
    out = loop.runner.run("backbone", {
        "anchor_ids": anchors, "positions": anchor_pos[:, None] + torch.arange(s.gamma + skip)[None],
        "ctx_k": ctx_k, "ctx_v": ctx_v, "ctx_mask": mask})
    return out["h"][:, skip:], out["base_logits"][:, skip:]  # [R, γ, d], [R, γ, V_d]
