"""Teacher-forced training forwards of the neural drafters, over padded batches of sequences.

Terms: S sequences of (padded) length n, each with features f_t [m·d] and teacher top-k at every
position t; N anchors per sequence; γ block size; V_d the drafter's vocabulary; k the teacher top-k.

Block drafters (DSpark, DFlash): every anchor a of a sequence gives one block [x_a, MASK × (γ−1)]
at positions a..a+γ−1 that attends to the injected context (positions < a) and bidirectionally to
itself; the N blocks of a sequence run in one attention call with a block-diagonal mask, sharing
the sequence's context K/V. Block position j predicts x_{a+j+1}, whose teacher is p at a+j. The
sequential head reads the true previous token x_{a+j} (teacher forcing), so all positions run in
one tensor op.

Eagle3 (training-time test): step 0 runs the layer causally over the sequence with inputs
W_in[emb(x_{t+1}); f_t]; step k ≥ 1 feeds W_in[emb(x_{t+k+1}); out_{k−1,t}] at position t+k and
attends to step-0 keys at positions ≤ t plus its own chain's keys of steps 1..k (one diagonal
each) — exactly what inference sees when the anchor is x_{t+1}. Step k at t predicts x_{t+k+2}.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import frozen

__all__ = ["Batch", "Targets", "block_forward", "eagle3_forward"]


@frozen
class Batch:
    ids: torch.Tensor  # [S, n] int64, padded with 0
    lengths: torch.Tensor  # [S] real lengths
    prompt_lens: torch.Tensor  # [S] the response starts here
    feats: torch.Tensor  # [S, n, m·d] target features at the drafter's layer ids
    top_ids: torch.Tensor  # [S, n, k] teacher's top-k next tokens (target ids)
    top_logp: torch.Tensor  # [S, n, k]
    anchors: torch.Tensor  # [S, N] anchor positions, −1 = none


@frozen
class Targets:
    """What the losses read, per (block or chain) × position."""

    logq: torch.Tensor  # [B, γ, V_d]
    label: torch.Tensor  # [B, γ] draft slot of the true next token, −1 outside the draft vocab
    p_slots: torch.Tensor  # [B, γ, k] draft slots of the teacher's top-k, −1 outside
    p_top: torch.Tensor  # [B, γ, k] teacher probabilities
    valid: torch.Tensor  # [B, γ] bool
    conf_logits: torch.Tensor | None  # [B, γ]


def _slots(drafter: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids → draft slots, −1 where the draft vocabulary has no slot."""
    s = drafter.to_draft(tokens)
    if drafter.vocab_map is not None:
        s = torch.where(s == drafter.draft_size - 1, torch.full_like(s, -1), s)
    return s


def block_forward(drafter: Any, batch: Batch) -> Targets:
    """DSpark / DFlash: [S sequences × N anchors] blocks → Targets with B = S·N."""
    S, n = batch.ids.shape
    N, g = batch.anchors.shape[1], drafter.gamma
    d = drafter.config.layer.hidden_size
    a = batch.anchors  # [S, N]
    has = a >= 0
    a0 = a.clamp_min(0)
    ctx = drafter.fuse_norm(drafter.fuse(batch.feats.to(drafter.fuse.weight.dtype)))  # [S, n, d]
    pos_ctx = torch.arange(n)[None].expand(S, n)  # [S, n]
    offs = torch.arange(g)  # [γ]
    blk_pos = (a0[..., None] + offs).reshape(S, N * g)  # [S, N·γ]
    x0 = drafter.embed(batch.ids.gather(1, a0))  # [S, N, d]
    x = torch.cat([x0[:, :, None], drafter.mask_embedding.expand(S, N, g - 1, d)], dim=2).reshape(S, N * g, d)
    ctx_ok = (torch.arange(n)[None, None] < a[..., None]) & (torch.arange(n)[None, None] < batch.lengths[:, None, None])
    ctx_ok = ctx_ok[:, :, None].expand(S, N, g, n).reshape(S, N * g, n)  # [S, N·γ, n]
    same_block = torch.block_diag(*[torch.ones(g, g, dtype=torch.bool)] * N)  # [N·γ, N·γ]
    mask = torch.cat([ctx_ok, same_block.expand(S, -1, -1)], dim=-1)  # [S, N·γ, n + N·γ]
    for layer in drafter.layers:
        k, v = layer.context_kv(ctx, pos_ctx)  # [S, H_kv, n, hd]
        x = layer(x, blk_pos, k, v, None, attn_mask=mask)
    h = drafter.norm(x).reshape(S * N, g, d)  # [B, γ, d]
    U = drafter.logits(h).float()  # [B, γ, V_d]
    idx = (a0[..., None] + offs).clamp(max=n - 1)  # [S, N, γ] position a+j (teacher, prev token)
    nxt = (a0[..., None] + offs + 1).clamp(max=n - 1)  # [S, N, γ] label position a+j+1
    prev = _slots(drafter, batch.ids.gather(1, idx.reshape(S, -1))).reshape(S * N, g)  # [B, γ]
    prev_in = prev.clamp_min(0) if drafter.vocab_map is None else torch.where(prev < 0, drafter.draft_size - 1, prev)
    conf = None
    if drafter.head is not None:
        U = drafter.head(prev_in, h, U)  # Ũ [B, γ, V_d]
        if drafter.confidence_head is not None:
            conf = drafter.confidence_head(h, drafter.head.prev_embedding(prev_in))  # [B, γ]
    label = _slots(drafter, batch.ids.gather(1, nxt.reshape(S, -1))).reshape(S * N, g)
    valid = has[..., None] & (a0[..., None] + offs + 1 < batch.lengths[:, None, None])  # [S, N, γ]
    k = batch.top_ids.shape[-1]
    gather = idx.reshape(S, N * g, 1).expand(-1, -1, k)
    p_ids = batch.top_ids.gather(1, gather).reshape(S * N, g, k)
    p_top = batch.top_logp.gather(1, gather).reshape(S * N, g, k).exp()
    return Targets(torch.log_softmax(U, dim=-1), label, _slots(drafter, p_ids), p_top,
                   valid.reshape(S * N, g), conf)


def eagle3_forward(drafter: Any, batch: Batch) -> Targets:
    """Eagle3 unrolled γ steps over every position: B = S·(n−1) chains (the anchor x_{t+1})."""
    S, n = batch.ids.shape
    g, s = drafter.gamma, drafter.config.layer
    layer = drafter.layer
    T = n - 1  # chains t = 0..n−2 (anchor x_{t+1}, feature f_t)
    t = torch.arange(T)
    f = drafter.fuse(batch.feats[:, :T].to(drafter.fuse.weight.dtype))  # [S, T, d]
    empty_k = f.new_zeros(S, s.num_kv_heads, 0, s.head_dim)
    empty_mask = torch.zeros(S, 0, dtype=torch.bool)
    keys, values, outs = [], [], []
    z = drafter._inputs(batch.ids[:, 1:], f)  # [S, T, d]
    causal = t[None, :] <= t[:, None]  # [T, T] query t sees key t' ≤ t
    diag = torch.eye(T, dtype=torch.bool)
    logqs, labels, p_ids, p_logp, valids = [], [], [], [], []
    for step in range(g):
        pos = (t + step)[None].expand(S, T)  # [S, T]
        if step == 0:
            mask = torch.cat([empty_mask[:, None, :].expand(S, T, 0), causal.expand(S, T, T)], -1)
            out, k, v = layer(z, pos, empty_k, empty_k, empty_mask, return_kv=True, attn_mask=mask)
        else:
            parts = [causal] + [diag] * (step - 1) + [diag]  # step-0 keys, chain keys 1..step−1, own
            mask = torch.cat(parts, dim=-1).expand(S, T, -1)  # [S, T, (step+1)·T]
            out, k, v = layer(z, pos, torch.cat(keys, 2), torch.cat(values, 2), None,
                              return_kv=True, attn_mask=mask)
        keys.append(k)
        values.append(v)
        h = drafter.norm(out)  # [S, T, d]
        logqs.append(torch.log_softmax(drafter.logits(h).float(), dim=-1))  # [S, T, V_d]
        lab_pos = (t + step + 2).clamp(max=n - 1)  # x_{t+step+2}
        tea_pos = (t + step + 1).clamp(max=n - 1)  # p at t+step+1
        labels.append(batch.ids[:, lab_pos])
        p_ids.append(batch.top_ids[:, tea_pos])
        p_logp.append(batch.top_logp[:, tea_pos])
        # the label must exist and lie in the response; anchors x_{t+1} from the last prompt token on
        valids.append((t + step + 2 < batch.lengths[:, None]) & (t[None] + 1 >= batch.prompt_lens[:, None] - 1))
        if step + 1 < g:
            nxt_tok = batch.ids[:, (t + step + 2).clamp(max=n - 1)]  # x_{t+step+2} (teacher forcing)
            z = drafter._inputs(nxt_tok, out)
    V = logqs[0].shape[-1]
    logq = torch.stack(logqs, 2).reshape(S * T, g, V)
    label = _slots(drafter, torch.stack(labels, 2).reshape(S * T, g))
    ids = torch.stack(p_ids, 2).reshape(S * T, g, -1)
    p_top = torch.stack(p_logp, 2).reshape(S * T, g, -1).exp()
    valid = torch.stack(valids, 2).reshape(S * T, g)
    return Targets(logq, label, _slots(drafter, ids), p_top, valid, None)
