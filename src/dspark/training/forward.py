"""Teacher-forced training forwards of the neural drafters, over padded batches of sequences.

Terms: S sequences of (padded) length n, each with features f_t [m·d] and a teacher at every
position t — the target's final-normed last hidden state z_t [d] (full-vocabulary teacher
p_t = softmax(W_lm z_t), computed in the step with the target's LM head) or a top-k summary;
N anchors per sequence; γ block size; V_d the drafter's vocabulary; k the teacher top-k.

Block drafters (DSpark, DFlash): every anchor a of a sequence gives one block [x_a, MASK × (γ−1)]
at positions a..a+γ−1 that attends to the injected context (positions < a) and bidirectionally to
itself; the N blocks of a sequence run in one attention call with a block-diagonal mask, sharing
the sequence's context K/V. Block position j predicts x_{a+j+1}, whose teacher is p at a+j. The
sequential head reads the true previous token x_{a+j} (teacher forcing), so all positions run in
one tensor op.

Eagle3 (training-time test), both layouts (reference ``eagle3``: q/k/v read
[norm(emb(x_{t+1})) ; norm(h_t)] with h_t = fc(f_t); ``eagle3-fused``: W_in[emb(x_{t+1}); f_t]): step 0
runs the layer causally over the sequence with (x_{t+1}, f_t); step k ≥ 1 feeds (x_{t+k+1}, out_{k−1,t})
at position t+k and
attends to step-0 keys at positions ≤ t plus its own chain's keys of steps 1..k — exactly what
inference sees when the anchor is x_{t+1}. Step k at t predicts x_{t+k+2}. Chains start at the
same sampled anchors as the block drafters' blocks (t = a − 1), so every drafter kind is trained on
the same positions.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import frozen

from dspark.training.losses import eval_mask

__all__ = ["Batch", "Targets", "teacher_at", "block_forward", "eagle3_forward"]


@frozen
class Batch:
    ids: torch.Tensor  # [S, n] int64, padded with 0
    lengths: torch.Tensor  # [S] real lengths
    prompt_lens: torch.Tensor  # [S] the response starts here
    feats: torch.Tensor  # [S, n, m·d] target features at the drafter's layer ids
    top_ids: torch.Tensor | None  # [S, n, k] top-k teacher: the target's k most likely next tokens
    top_logp: torch.Tensor | None  # [S, n, k] their log-probabilities
    anchors: torch.Tensor  # [S, N] anchor positions, −1 = none
    last_hidden: torch.Tensor | None = None  # [S, n, d] full teacher: target's final-normed last hidden state
    loss_mask: torch.Tensor | None = None  # [S, n] 1 = supervised label position; None: prompt_len ≤ t < length
    last_lse: torch.Tensor | None = None  # [S, n] log Σ_v exp(W_lm z_t) over the full vocabulary (optional)

    def mask(self) -> torch.Tensor:
        """The loss mask [S, n] float (default: the response, prompt_lens ≤ t < lengths)."""
        if self.loss_mask is not None:
            return self.loss_mask.float()
        t = torch.arange(self.ids.shape[1])[None]
        return ((t >= self.prompt_lens[:, None]) & (t < self.lengths[:, None])).float()


@frozen
class Targets:
    """What the losses read, per row (block or chain) × position (Eagle3: step).

    The teacher comes in one of two forms (``teacher_at``): full vocabulary (``p``, ``p_out``) or
    top-k (``p_slots``, ``p_top``); the other pair is None. ``valid`` is the supervision mask
    (block drafters: the reference's cumulative ``eval_mask``). ``weight`` / ``den``: per-token
    loss weights and the normaliser, when a forward sets them itself (Eagle3 may: see
    ``losses.eagle3_loss_weights``); None = the trainer derives them from ``valid``.
    """

    logq: torch.Tensor  # [B, γ, V_d]
    label: torch.Tensor  # [B, γ] draft slot of the true next token, −1 outside the draft vocab
    p_slots: torch.Tensor | None  # [B, γ, k] top-k teacher: draft slots of its top-k, −1 outside
    p_top: torch.Tensor | None  # [B, γ, k] their probabilities
    valid: torch.Tensor  # [B, γ] bool
    conf_logits: torch.Tensor | None  # [B, γ]
    p: torch.Tensor | None = None  # [B, γ, V_d] full teacher: probability of each draft slot's token
    p_out: torch.Tensor | None = None  # [B, γ] full teacher's mass outside the draft vocabulary
    weight: torch.Tensor | None = None  # [B, γ] float loss weights (None: derived by the trainer)
    den: torch.Tensor | None = None  # scalar normaliser of this micro-batch (None: Σ weight)
    hidden: torch.Tensor | None = None  # [B, γ, d] block drafters: backbone output after the final norm
    logits: torch.Tensor | None = None  # [B, γ, V_d] the logits logq was normalised from (Ũ)


_TEACHER_ROWS = 1024  # distinct positions per teacher matmul: [rows, V] fp32 ≈ 200 MB at V = 49152


def _row_groups(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive index ranges [r0, r1) whose ``sizes`` sum to ≤ ``limit`` (an item larger than
    ``limit`` forms a range of its own)."""
    groups: list[tuple[int, int]] = []
    r0, rows = 0, 0
    for r, n in enumerate(sizes):
        if r > r0 and rows + n > limit:
            groups.append((r0, r))
            r0, rows = r, 0
        rows += n
    return groups + [(r0, len(sizes))] if sizes else groups


@torch.no_grad()
def teacher_at(drafter: Any, batch: Batch, pos: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The teacher distribution at positions ``pos`` [S, M] (the target's distribution of token
    pos + 1) → (p_slots, p_top, p, p_out), each [S, M, ·], the unused pair None.

    Full (``batch.last_hidden`` set): p = softmax(W_lm z_pos) over the target vocabulary with the
    drafter's bound full LM head, read at the draft slots (placeholder slot 0), p_out the rest.
    With a reduced draft vocabulary and the cached full-vocabulary normaliser ``batch.last_lse``,
    only the V_d draft rows of W_lm are multiplied: p_slot = exp(W_lm[slot] z − lse), same values.
    Each distinct position of a sequence is computed once (blocks overlap).
    Top-k (``batch.top_ids``): the k ids mapped to draft slots and their probabilities.
    """
    S, M = pos.shape
    pos = pos.clamp(0, batch.ids.shape[1] - 1)
    if batch.last_hidden is not None:
        W = drafter._lm_head_full  # [V, d]
        if W is None:
            raise RuntimeError("bind_target(embed, lm_head) must be called before training")
        reduced = drafter.vocab_map is not None
        lse_path = reduced and batch.last_lse is not None
        # The LM head in the matmul dtype, cast once here: under autocast each z @ W.T would cast
        # the whole [V, d] weight again (a sequence at a time: S casts of V·d a step). Same values.
        dev = W.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else W.dtype
        W_c = (drafter._lm_head if lse_path else W).to(dt)  # [V_d or V, d]
        uniq = [pos[r].unique(return_inverse=True) for r in range(S)]  # ([M'] distinct, [M] index)
        ps, outs = [], []
        # sequences in groups of ≤ _TEACHER_ROWS distinct positions: the fp32 logits bound memory
        for r0, r1 in _row_groups([u.numel() for u, _ in uniq], _TEACHER_ROWS):
            z = torch.cat([batch.last_hidden[r, uniq[r][0]] for r in range(r0, r1)]).to(dt)  # [Σ M', d]
            if lse_path:
                lse = torch.cat([batch.last_lse[r, uniq[r][0]] for r in range(r0, r1)]).float()
                p_d = torch.exp((z @ W_c.T).float() - lse[:, None])  # [Σ M', V_d]
            else:
                p_full = torch.softmax(z @ W_c.T, dim=-1, dtype=torch.float32)  # [Σ M', V]
                p_d = p_full[:, drafter.draft_ids] if reduced else p_full
            if reduced:
                p_d[:, -1] = 0.0  # the placeholder slot scores nothing
                out = (1.0 - p_d.sum(-1)).clamp_min(0.0)
            else:
                out = p_d.new_zeros(p_d.shape[0])
            off = 0
            for r in range(r0, r1):
                u, inv = uniq[r]
                ps.append(p_d[off : off + u.numel()][inv])
                outs.append(out[off : off + u.numel()][inv])
                off += u.numel()
        return None, None, torch.stack(ps), torch.stack(outs)
    if batch.top_ids is None or batch.top_logp is None:
        raise ValueError("the batch has no teacher (neither last_hidden nor top_ids / top_logp)")
    k = batch.top_ids.shape[-1]
    idx = pos[..., None].expand(S, M, k)
    return _slots(drafter, batch.top_ids.gather(1, idx)), batch.top_logp.gather(1, idx).float().exp(), None, None


def _rows(tensors: tuple[torch.Tensor | None, ...], B: int, g: int) -> tuple[torch.Tensor | None, ...]:
    """Teacher tensors [S, N·γ, ...] → [B = S·N, γ, ...] (None stays None)."""
    return tuple(None if t is None else t.reshape(B, g, *t.shape[2:]) for t in tensors)


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
    # supervised while the label a+j+1 is inside the sequence and in the loss mask (cumulative)
    valid = eval_mask(a0[..., None] + offs + 1, batch.mask(), has)  # [S, N, γ]
    # teacher at a+j: p_{a+j} is the target's distribution of x_{a+j+1}; like the reference, a label
    # index clamped to n−1 reads the teacher at n−2 (such slots are masked anyway)
    p_slots, p_top, p, p_out = teacher_at(drafter, batch, (nxt - 1).reshape(S, N * g))

    p_slots, p_top, p, p_out = _rows((p_slots, p_top, p, p_out), S * N, g)
    return Targets(torch.log_softmax(U, dim=-1), label, p_slots, p_top, valid.reshape(S * N, g), conf,
                   p=p, p_out=p_out, hidden=h, logits=U)


def eagle3_forward(drafter: Any, batch: Batch) -> Targets:
    """Eagle3 unrolled γ steps for the chains that start at the batch's anchors: B = S·N chains.

    The chain anchored at x_a starts at t = a − 1. Step 0 runs causally over the whole sequence
    (every position's K/V is context for later chains); steps ≥ 1 run for the N chains only, each
    attending to step-0 keys at positions ≤ t and to its own keys of the earlier steps.
    """
    S, n = batch.ids.shape
    N, g, s = batch.anchors.shape[1], drafter.gamma, drafter.config.layer
    T = n - 1  # step-0 positions t = 0..n−2 (input x_{t+1}, feature f_t)
    t_all = torch.arange(T)
    f = drafter._fuse(batch.feats[:, :T])  # [S, T, d]
    empty_k = f.new_zeros(S, s.num_kv_heads, 0, s.head_dim)
    causal = (t_all[None, :] <= t_all[:, None]).expand(S, T, T)  # [S, T, T]
    out0, k0, v0 = drafter._run(batch.ids[:, 1:], f, t_all[None].expand(S, T), empty_k, empty_k, None, attn_mask=causal)
    t = batch.anchors - 1  # [S, N] chain start
    has = t >= 0
    t0 = t.clamp(0, T - 1)
    pick = t0[..., None].expand(S, N, out0.shape[-1])
    out = out0.gather(1, pick)  # [S, N, d] step-0 output of each chain
    ctx_seen = t_all[None, None, :] <= t0[..., None]  # [S, N, T] step-0 keys a chain may see
    eye = torch.eye(N, dtype=torch.bool).expand(S, N, N)
    keys, values = [k0], [v0]
    logqs, labels, tea_pos_all, valids = [], [], [], []
    for step in range(g):
        if step > 0:
            nxt_tok = batch.ids.gather(1, (t0 + step + 1).clamp(max=n - 1))  # x_{t+step+1} (teacher forcing)
            mask = torch.cat([ctx_seen] + [eye] * step, dim=-1)  # [S, N, T + step·N]
            out, k, v = drafter._run(nxt_tok, out, t0 + step, torch.cat(keys, 2), torch.cat(values, 2), None,
                                     attn_mask=mask)
            keys.append(k)
            values.append(v)
        h = drafter.norm(out)  # [S, N, d]
        logqs.append(torch.log_softmax(drafter.logits(h).float(), dim=-1))  # [S, N, V_d]
        lab_pos = (t0 + step + 2).clamp(max=n - 1)  # x_{t+step+2}
        tea_pos = (t0 + step + 1).clamp(max=n - 1)  # p at t+step+1
        labels.append(batch.ids.gather(1, lab_pos))
        tea_pos_all.append(tea_pos)
        valids.append(has & (t0 + step + 2 < batch.lengths[:, None]))
    V = logqs[0].shape[-1]
    logq = torch.stack(logqs, 2).reshape(S * N, g, V)
    label = _slots(drafter, torch.stack(labels, 2).reshape(S * N, g))
    valid = torch.stack(valids, 2).reshape(S * N, g)
    # the teacher (full vocabulary or top-k) at t+step+1 for every chain and step: [S, N·γ]
    p_slots, p_top, p, p_out = teacher_at(drafter, batch, torch.stack(tea_pos_all, 2).reshape(S, N * g))

    p_slots, p_top, p, p_out = _rows((p_slots, p_top, p, p_out), S * N, g)
    return Targets(logq, label, p_slots, p_top, valid, None, p=p, p_out=p_out)
