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
attends to step-0 keys at positions ≤ t plus its own chain's keys of steps 1..k — exactly what
inference sees when the anchor is x_{t+1}. Step k at t predicts x_{t+k+2}. Chains start at the
same sampled anchors as the block drafters' blocks (t = a − 1), so every drafter kind is trained on
the same positions.
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
    x = torch.cat([x0[:, :, None], drafter.mask_vector().expand(S, N, g - 1, d)], dim=2).reshape(S, N * g, d)
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
    prev = drafter.to_draft(batch.ids.gather(1, idx.reshape(S, -1))).reshape(S * N, g)  # [B, γ] x̂_{j−1} slots
    conf = None
    if drafter.head is not None:
        U = drafter.head(prev, h, U)  # Ũ [B, γ, V_d]
        if drafter.confidence_head is not None:
            conf = drafter.confidence_head(h, drafter.head.prev_embedding(prev))  # [B, γ]
    label = _slots(drafter, batch.ids.gather(1, nxt.reshape(S, -1))).reshape(S * N, g)
    valid = has[..., None] & (a0[..., None] + offs + 1 < batch.lengths[:, None, None])  # [S, N, γ]
    k = batch.top_ids.shape[-1]
    gather = idx.reshape(S, N * g, 1).expand(-1, -1, k)
    p_ids = batch.top_ids.gather(1, gather).reshape(S * N, g, k)
    p_top = batch.top_logp.gather(1, gather).reshape(S * N, g, k).exp()
    return Targets(torch.log_softmax(U, dim=-1), label, _slots(drafter, p_ids), p_top,
                   valid.reshape(S * N, g), conf)


def eagle3_forward(drafter: Any, batch: Batch) -> Targets:
    """Eagle3 unrolled γ steps for the chains that start at the batch's anchors: B = S·N chains.

    The chain anchored at x_a starts at t = a − 1. Step 0 runs causally over the whole sequence
    (every position's K/V is context for later chains); steps ≥ 1 run for the N chains only, each
    attending to step-0 keys at positions ≤ t and to its own keys of the earlier steps.
    """
    S, n = batch.ids.shape
    N, g, s = batch.anchors.shape[1], drafter.gamma, drafter.config.layer
    layer = drafter.layer
    T = n - 1  # step-0 positions t = 0..n−2 (input x_{t+1}, feature f_t)
    t_all = torch.arange(T)
    f = drafter.fuse(batch.feats[:, :T].to(drafter.fuse.weight.dtype))  # [S, T, d]
    z = drafter._inputs(batch.ids[:, 1:], f)  # [S, T, d]
    empty_k = f.new_zeros(S, s.num_kv_heads, 0, s.head_dim)
    causal = (t_all[None, :] <= t_all[:, None]).expand(S, T, T)  # [S, T, T]
    out0, k0, v0 = layer(z, t_all[None].expand(S, T), empty_k, empty_k, None, return_kv=True, attn_mask=causal)
    t = batch.anchors - 1  # [S, N] chain start
    has = t >= 0
    t0 = t.clamp(0, T - 1)
    pick = t0[..., None].expand(S, N, out0.shape[-1])
    out = out0.gather(1, pick)  # [S, N, d] step-0 output of each chain
    ctx_seen = t_all[None, None, :] <= t0[..., None]  # [S, N, T] step-0 keys a chain may see
    eye = torch.eye(N, dtype=torch.bool).expand(S, N, N)
    keys, values = [k0], [v0]
    logqs, labels, p_ids, p_logp, valids = [], [], [], [], []
    for step in range(g):
        if step > 0:
            nxt_tok = batch.ids.gather(1, (t0 + step + 1).clamp(max=n - 1))  # x_{t+step+1} (teacher forcing)
            z = drafter._inputs(nxt_tok, out)  # [S, N, d]
            mask = torch.cat([ctx_seen] + [eye] * step, dim=-1)  # [S, N, T + step·N]
            out, k, v = layer(z, t0 + step, torch.cat(keys, 2), torch.cat(values, 2), None,
                              return_kv=True, attn_mask=mask)
            keys.append(k)
            values.append(v)
        h = drafter.norm(out)  # [S, N, d]
        logqs.append(torch.log_softmax(drafter.logits(h).float(), dim=-1))  # [S, N, V_d]
        lab_pos = (t0 + step + 2).clamp(max=n - 1)  # x_{t+step+2}
        tea_pos = (t0 + step + 1).clamp(max=n - 1)  # p at t+step+1
        labels.append(batch.ids.gather(1, lab_pos))
        kk = batch.top_ids.shape[-1]
        p_ids.append(batch.top_ids.gather(1, tea_pos[..., None].expand(S, N, kk)))
        p_logp.append(batch.top_logp.gather(1, tea_pos[..., None].expand(S, N, kk)))
        valids.append(has & (t0 + step + 2 < batch.lengths[:, None]))
    V = logqs[0].shape[-1]
    logq = torch.stack(logqs, 2).reshape(S * N, g, V)
    label = _slots(drafter, torch.stack(labels, 2).reshape(S * N, g))
    ids = torch.stack(p_ids, 2).reshape(S * N, g, -1)
    p_top = torch.stack(p_logp, 2).reshape(S * N, g, -1).exp()
    valid = torch.stack(valids, 2).reshape(S * N, g)
    return Targets(logq, label, _slots(drafter, ids), p_top, valid, None)
