"""Training losses (DESIGN.md §3), as small pure functions.

Terms, once. B blocks (or sequence positions), γ positions per block, V_d the drafter's
vocabulary (the reduced draft vocabulary, or the target's V), k the teacher's top-k.

* ``logq`` [B, γ, V_d]: the drafter's log-probabilities, log softmax(Ũ_j) (sequential-head-
  corrected for DSpark, U_j for DFlash, the chain logits for Eagle3).
* Teacher p_j as its top-k: ``p_slots`` [B, γ, k] the draft slot of each of the target's k most
  likely tokens (``-1`` where the token is outside the draft vocabulary) and ``p_top`` [B, γ, k]
  their probabilities. Mass outside the top-k is treated as disjoint from q: the L1 below is then
  an upper bound of ‖p − q‖₁ and the overlap α a lower bound of Σ min(p, q), exact as k → V.
* ``label`` [B, γ]: the draft slot of the data's next token (``-1``: outside the draft vocabulary).
* ``valid`` [B, γ] bool: positions with a label inside the sequence's response.
* w_j = exp(−j / γ_decay), normalised over j = 0..γ−1 (position decay; γ_decay = 4).

Per position: CE_j = −log q_j(label), L1_j = ‖p_j − q_j‖₁, α_j = Σ_v min(p_j(v), q_j(v)) =
1 − ½‖p_j − q_j‖₁ (the acceptance probability of a token drawn from q_j), and the confidence
loss BCE(c_j, α_j.detach()). Losses are *sums* over blocks divided by a caller-given ``norm``
(the number of blocks in the global batch), so data-parallel ranks add up to exactly the
single-process loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["position_weights", "teacher_overlap", "block_losses", "soft_ce", "analytic_tau"]


def position_weights(gamma: int, decay: float = 4.0) -> torch.Tensor:
    """w_j = exp(−j/decay) / Σ_i exp(−i/decay), j = 0..γ−1 → [γ]."""
    if gamma < 1 or decay <= 0:
        raise ValueError(f"need gamma >= 1 and decay > 0, got {gamma}, {decay}")
    w = torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)
    return w / w.sum()


def teacher_overlap(logq: torch.Tensor, p_slots: torch.Tensor, p_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L1_j, α_j), each [B, γ], from logq [B, γ, V_d] and the teacher's top-k [B, γ, k]."""
    inside = p_slots >= 0  # [B, γ, k]
    q_top = logq.gather(-1, p_slots.clamp_min(0)).exp() * inside  # [B, γ, k] q at the teacher's tokens
    p_in = p_top * inside
    l1 = (p_in - q_top).abs().sum(-1) + (p_top * ~inside).sum(-1) + (1.0 - q_top.sum(-1)).clamp_min(0)
    alpha = torch.minimum(p_in, q_top).sum(-1)  # [B, γ]
    return l1, alpha


def soft_ce(logq: torch.Tensor, p_slots: torch.Tensor, p_top: torch.Tensor) -> torch.Tensor:
    """−Σ_k p_k log q(slot_k) over the teacher's in-vocabulary top-k → [B, γ] (Eagle3's loss)."""
    inside = p_slots >= 0
    return -(logq.gather(-1, p_slots.clamp_min(0)) * p_top * inside).sum(-1)


def block_losses(
    logq: torch.Tensor,
    label: torch.Tensor,
    p_slots: torch.Tensor,
    p_top: torch.Tensor,
    valid: torch.Tensor,
    conf_logits: torch.Tensor | None,
    *,
    norm: float,
    lambda_ce: float = 0.1,
    lambda_l1: float = 0.9,
    lambda_conf: float = 1.0,
    lambda_soft_ce: float = 0.0,
    decay: float = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = Σ_blocks Σ_j w_j (λ_CE CE_j + λ_L1 L1_j + λ_soft soft-CE_j + λ_conf BCE_j) / norm.

    Returns the loss (a scalar to backpropagate) and detached statistics: per-position sums of
    α (``alpha_sum`` [γ]) and counts (``count`` [γ]), and each term's contribution.
    """
    gamma = logq.shape[-2]
    w = position_weights(gamma, decay).to(logq.device)  # [γ]
    validf = valid.float()  # [B, γ]
    has_label = valid & (label >= 0)
    ce = -logq.gather(-1, label.clamp_min(0)[..., None]).squeeze(-1) * has_label  # [B, γ]
    l1, alpha = teacher_overlap(logq, p_slots, p_top)  # [B, γ]
    parts = {"ce": lambda_ce * (w * ce).sum(), "l1": lambda_l1 * (w * l1 * validf).sum()}
    if lambda_soft_ce:
        parts["soft_ce"] = lambda_soft_ce * (w * soft_ce(logq, p_slots, p_top) * validf).sum()
    if conf_logits is not None and lambda_conf:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), alpha.detach(), reduction="none")
        parts["conf"] = lambda_conf * (w * bce * validf).sum()
    loss = sum(parts.values()) / norm
    stats = {k: v.detach() / norm for k, v in parts.items()}
    stats["alpha_sum"] = (alpha.detach() * validf).sum(0)  # [γ]
    stats["count"] = validf.sum(0)  # [γ]
    return loss, stats


def analytic_tau(alpha_mean: list[float] | torch.Tensor) -> float:
    """Expected committed tokens per round when every position is verified, from the mean
    per-position overlap: τ = 1 + Σ_{k=1..γ} Π_{j≤k} ᾱ_j (an approximation: it treats positions
    as independent)."""
    tau, run = 1.0, 1.0
    for a in [float(x) for x in alpha_mean]:
        if math.isnan(a):
            break
        run *= a
        tau += run
    return tau
