"""DFlash's training recipe, the one every block drafter (DFlash, DSpark) trains with: the
teacher-forced block forward and the reference's block loss.

Terms as in :mod:`dspark.training.forward`. Every anchor a of a sequence gives one block
[x_a, MASK × (γ−1)] at positions a..a+γ−1 that attends to the injected context (positions < a)
and bidirectionally to itself; the N blocks of a sequence run in one attention call with a
block-diagonal mask, sharing the sequence's context K/V. Block position j predicts x_{a+j+1},
whose teacher is p at a+j. DSpark's sequential head reads the true previous token x_{a+j}
(teacher forcing, the module's ``refine``), so all positions run in one tensor op.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.training.forward import Batch, Targets, draft_slots, per_row, teacher_at
from dspark.training.losses import block_terms, eval_mask, loss_weights

__all__ = ["block_forward", "BlockLoss"]


def block_forward(drafter: Any, batch: Batch) -> Targets:
    """DFlash / DSpark: [S sequences × N anchors] blocks → Targets with B = S·N."""
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
    U, conf = drafter.refine(prev, h, U)  # DSpark: Ũ [B, γ, V_d] and confidence logits [B, γ]
    label = draft_slots(drafter, batch.ids.gather(1, nxt.reshape(S, -1))).reshape(S * N, g)
    # supervised while the label a+j+1 is inside the sequence and in the loss mask (cumulative)
    valid = eval_mask(a0[..., None] + offs + 1, batch.mask(), has)  # [S, N, γ]
    # teacher at a+j: p_{a+j} is the target's distribution of x_{a+j+1}; like the reference, a label
    # index clamped to n−1 reads the teacher at n−2 (such slots are masked anyway)
    p_slots, p_top, p, p_out = teacher_at(drafter, batch, (nxt - 1).reshape(S, N * g))

    p_slots, p_top, p, p_out = per_row((p_slots, p_top, p, p_out), S * N, g)
    return Targets(torch.log_softmax(U, dim=-1), label, p_slots, p_top, valid.reshape(S * N, g), conf,
                   p=p, p_out=p_out, hidden=h, logits=U)


class BlockLoss:
    """DFlash / DSpark: λ_ce·CE + λ_l1·L1 + λ_conf·confidence BCE, positions weighted
    exp(−(j−1)/decay) (``c``: a :class:`~dspark.training.trainer.TrainConfig`)."""

    @staticmethod
    def terms(c: Any, t: Targets) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        w = t.weight if t.weight is not None else loss_weights(t.valid, c.decay)
        total, nums, per = block_terms(t.logq.float(), t.label, w, t.conf_logits, **t.teacher(),
                                       lambda_ce=c.lambda_ce, lambda_l1=c.lambda_l1, lambda_conf=c.lambda_conf)
        den = t.den if t.den is not None else nums.pop("den")
        nums.pop("den", None)
        return total, nums, den, per

    @staticmethod
    def lambdas(c: Any) -> dict[str, float]:
        return {"ce": c.lambda_ce, "l1": c.lambda_l1, "conf": c.lambda_conf}
