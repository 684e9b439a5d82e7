"""Eagle3's training recipe (both layouts): the training-time test forward and the reference's
soft-label loss.

Terms as in :mod:`dspark.training.forward`. Reference ``eagle3``: q/k/v read
[norm(emb(x_{t+1})) ; norm(h_t)] with h_t = fc(f_t); ``eagle3-fused``: W_in[emb(x_{t+1}); f_t].
Step 0 runs the layer causally over the sequence with (x_{t+1}, f_t); step k ≥ 1 feeds
(x_{t+k+1}, out_{k−1,t}) at position t+k and attends to step-0 keys at positions ≤ t plus its own
chain's keys of steps 1..k — exactly what inference sees when the anchor is x_{t+1}. Step k at t
predicts x_{t+k+2}. Chains start at the same sampled anchors as the block drafters' blocks
(t = a − 1), so every drafter kind is trained on the same positions.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.training.forward import Batch, Targets, draft_slots, per_row, teacher_at
from dspark.training.losses import eagle3_loss_weights, eagle3_terms

__all__ = ["eagle3_forward", "Eagle3Loss"]


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
    label = draft_slots(drafter, torch.stack(labels, 2).reshape(S * N, g))
    valid = torch.stack(valids, 2).reshape(S * N, g)
    # the teacher (full vocabulary or top-k) at t+step+1 for every chain and step: [S, N·γ]
    p_slots, p_top, p, p_out = teacher_at(drafter, batch, torch.stack(tea_pos_all, 2).reshape(S, N * g))

    p_slots, p_top, p, p_out = per_row((p_slots, p_top, p, p_out), S * N, g)
    return Targets(logq, label, p_slots, p_top, valid, None, p=p, p_out=p_out)


class Eagle3Loss:
    """Eagle3: full-vocabulary soft CE, step k weighted step_decay^k, a mean over chains (``c``: a
    :class:`~dspark.training.trainer.TrainConfig`)."""

    @staticmethod
    def terms(c: Any, t: Targets) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        w = t.weight if t.weight is not None else eagle3_loss_weights(t.valid, c.step_decay)
        num, nums, per = eagle3_terms(t.logq.float(), w, **t.teacher())
        den = t.den if t.den is not None else t.valid.any(-1).sum().float()  # chains
        return c.lambda_soft_ce * num, nums, den, per

    @staticmethod
    def lambdas(c: Any) -> dict[str, float]:
        return {"soft_ce": c.lambda_soft_ce, "l1": 0.0}
