"""Eagle3's drafting round (both layouts): γ causal steps of one layer.

Terms as in :mod:`dspark.drafters.loop`. The fused feature of the last context position waits
("pending") for its next token; the K/V of a causal layer's context position need no past, so
context ingestion is packed over requests; the γ steps write their K/V into preallocated slots
after the padded context, masked until written.
"""

from __future__ import annotations

import time

import torch

from dspark.drafters.draws import Draws, feature_starts
from dspark.drafters.loop import DraftingLoop
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["autoregressive_round"]


def autoregressive_round(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
    """Eagle3: fuse and cache new context positions, then γ causal steps of one layer.

    The layer at position t reads (x_{t+1}, h_t): h_t the fused feature f_t of a context position
    or the previous step's output; the last context feature (t = a − 1, paired with the anchor) is
    the first drafting step, so it stays pending until the round that drafts from it.
    """
    s = loop.spec
    R, d = len(context.request_ids), s.hidden_size
    loop.check_limit("step", "batch", R)
    t0 = time.perf_counter()
    sizes = [f.shape[0] for f in feats]
    fused_all = None
    if sum(sizes):
        fused_all = loop.run_packed("fuse", {"features": torch.cat(feats)}, {"features": 0}, {"fused": 0})["fused"]
    caches, last_feat, off = [], [], 0
    toks, ready, positions, owners = [], [], [], []
    for rid, ids, n, start in zip(context.request_ids, context.token_ids, sizes, feature_starts(context)):
        cache = loop.cache_for(rid, start)
        caches.append(cache)
        fused = fused_all[off : off + n] if n else None
        off += n
        pending = loop.pending.get(rid)
        if pending is not None:
            fused = pending if fused is None else torch.cat([pending, fused])
        if fused is None or fused.shape[0] == 0:
            # A one-token prompt has no target feature yet: draft from a zero feature once, and do
            # not cache it (position −1 does not exist).
            last_feat.append(None)
            loop.pending[rid] = None
            owners.append((rid, ids, cache, 0, None))
            continue
        # Positions t with both f_t and x_{t+1} committed go into the cache.
        n_ready = fused.shape[0] - 1
        if n_ready > 0:
            at = cache.end
            toks.append(ids[at + 1 : at + 1 + n_ready].long())
            ready.append(fused[:n_ready])
            positions.append(torch.arange(at, at + n_ready))
        loop.pending[rid] = fused[-1:]
        last_feat.append(fused[-1])
        owners.append((rid, ids, cache, n_ready, fused))
    if toks:
        out = loop.run_packed(
            "context", {"token_ids": torch.cat(toks), "feats": torch.cat(ready), "positions": torch.cat(positions)},
            {"token_ids": 0, "feats": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
        k, v, off = out["ctx_k"], out["ctx_v"], 0  # [1, H_kv, N, hd]
        for _rid, _ids, cache, n_ready, _f in owners:
            if n_ready:
                cache.append(k[:, :, off : off + n_ready], v[:, :, off : off + n_ready])
                off += n_ready
    for rid, ids, cache, _n, fused in owners:
        if fused is not None:
            loop.check_anchor(rid, cache, ids, lag=2)
    t_ingest = time.perf_counter() - t0
    t0 = time.perf_counter()
    zero = torch.zeros(d, device=loop.device, dtype=loop.dtype)
    feat = torch.stack([zero if f is None else f for f in last_feat])  # [R, d]
    P0 = max(c.length for c in caches)
    k_ctx, v_ctx, mask = loop.gather(caches, extra=s.gamma)  # [1, R, H_kv, P0 + γ, hd]
    loop.check_limit("step", "past", mask.shape[1])
    tok = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R] x_{t+1} = anchor
    pos = torch.tensor([ids.numel() - 2 for ids in context.token_ids])  # [R] t = a − 1
    draws, hidden = Draws(loop, context), []
    for j in range(s.gamma):
        out = loop.runner.run("step", {
            "token_ids": tok[:, None].to(loop.device), "feats": feat[:, None].contiguous(), "positions": pos[:, None],
            "ctx_k": k_ctx, "ctx_v": v_ctx, "ctx_mask": mask})
        at = P0 + j  # the step's K/V slot after the padded context
        k_ctx[:, :, :, at] = out["k_new"][:, :, :, 0]
        v_ctx[:, :, :, at] = out["v_new"][:, :, :, 0]
        mask[:, at] = True
        slot = draws.draw(out["logits"][:, 0])  # [R] draft slot of x̂_j
        hidden.append(out["out"][:, 0])
        nxt = slot if s.vocab_map is None else s.vocab_map.to_target(slot)  # the layer reads target ids
        tok, feat, pos = nxt, out["out"][:, 0], pos + 1
    tokens, q, logits = draws.finish()
    loop.timings = {"draft": time.perf_counter() - t0, "sequential_head": 0.0, "ingest": t_ingest}
    return DraftBlock(
        tokens=tokens, q=q, valid_lengths=loop.valid(context, R), draft_logits=logits,
        hidden=torch.stack(hidden, 1).cpu() if s.returns_hidden else None,  # [R, γ, d] pre-norm outputs
    )
