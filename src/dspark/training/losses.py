"""Training losses, as small pure functions, reference-exact with DeepSpec's
``deepspec/modeling/dspark/loss.py`` (block drafters) and ``deepspec/modeling/eagle3/loss.py``
(Eagle3's step weights).

Terms, once. B rows (blocks; for Eagle3 chains or sequence positions), γ positions per row
(Eagle3: K training-time-test steps), V_d the drafter's vocabulary (the reduced draft vocabulary,
or the target's V), k a top-k teacher's k.

* ``logq`` [B, γ, V_d]: the drafter's log-probabilities log softmax(Ũ_j) (sequential-head-
  corrected for DSpark, U_j for DFlash, the step logits for Eagle3). q_j = exp(logq_j).
* Teacher p_j, the target's distribution of the token q_j predicts (T = 1), in one of two forms:
  - full vocabulary (the reference; default): ``p`` [B, γ, V_d] the target's probability of each
    draft slot's token (0 for the placeholder slot of a reduced vocabulary) and ``p_out`` [B, γ]
    the target's mass on tokens *outside* the draft vocabulary (0 without a reduced vocabulary).
    Exact: q is 0 outside the draft slots, so ‖q − p‖₁ = Σ_slots |q − p| + p_out.
  - top-k (``teacher="topk"``, cheaper to cache): ``p_slots`` [B, γ, k] the draft slot of each of
    the target's k most likely tokens (−1 outside the draft vocabulary) and ``p_top`` [B, γ, k]
    their probabilities. The mass outside the top-k is taken as disjoint from q, so the L1 is an
    upper bound of ‖q − p‖₁ and the acceptance rate below a lower bound (biased low).
* ``label`` [B, γ]: the draft slot of the data's next token (−1: outside the draft vocabulary;
  its CE is then 0 — the reference has no reduced vocabulary).
* ``eval_mask`` [B, γ] (block drafters): slot j of the block anchored at a predicts x_{a+j+1};
  it is supervised while that label position is inside the sequence and its ``loss_mask`` is 1,
  as a cumulative product along j (the first unsupervised label ends the block's supervision).
* ``loss_weight`` w [B, γ] = eval_mask · exp(−j / γ_decay) (γ_decay = 4; *not* normalised over j).

Per token: CE_j = −log q_j(label_j); L1_j = ‖q_j − p_j‖₁ (= 2·TV); the acceptance rate
α_j = clamp(1 − L1_j / 2, 0, 1) (= Σ_v min(p_j, q_j), the probability that a token drawn from q_j
is accepted); BCE_j = BCE-with-logits(c_j, α_j.detach()) for the confidence logit c_j.

Reduction (the reference's): each loss term is num / (den + 1e-6) with num = Σ w·ℓ and
den = Σ w over every token of the *global* batch. Both are plain sums, so data-parallel ranks and
gradient-accumulation micro-batches add their (num, den) — the trainer all-reduces den and
scales the gradient of Σ num by 1 / (den + 1e-6) — and get exactly the single-process loss.
Block drafters: loss = λ_CE·CE + λ_L1·L1 + λ_conf·BCE (DSpark 0.1 / 0.9 / 1.0, DFlash 1 / 0 / 0).

Eagle3 (DeepSpec ``compute_eagle3_loss``): step k has weight ``step_loss_decay``^k (0.8) and a
full-vocabulary soft cross-entropy −Σ_v p_k(v) log q_k(v); each step's sum over valid positions is
divided by the sequence's (padded) length T (``local_mean`` with one sequence per micro-batch),
and the data-parallel average makes it a mean over sequences. As (num, den): w = valid·0.8^k / T
per row, den = the number of sequences (:func:`eagle3_loss_weights`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "DEN_EPS",
    "eval_mask",
    "loss_weights",
    "eagle3_loss_weights",
    "ce_per_token",
    "l1_per_token",
    "l1_per_token_topk",
    "accept_rate",
    "bce_per_token",
    "soft_ce_per_token",
    "soft_ce_per_token_topk",
    "weighted",
    "normalise",
    "block_terms",
    "eagle3_terms",
    "analytic_tau",
]

DEN_EPS = 1e-6  # the reference's num / (den + 1e-6)


def eval_mask(label_pos: torch.Tensor, loss_mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Supervised block slots → [S, N, γ] bool.

    label_pos [S, N, γ] int64 = a + j + 1 (may run past the sequence), loss_mask [S, n] (0 on
    prompt and padding), keep [S, N] bool (False: no anchor). 1 while label_pos < n and
    loss_mask[label_pos] = 1, as a cumulative product along j.
    """
    S, N, g = label_pos.shape
    n = loss_mask.shape[1]
    inside = label_pos < n  # [S, N, γ]
    lm = loss_mask.gather(1, label_pos.clamp(0, n - 1).reshape(S, N * g)).reshape(S, N, g) > 0.5
    ok = inside & lm
    if keep is not None:
        ok = ok & keep[..., None]
    return ok.to(torch.int32).cumprod(dim=-1).bool()


def loss_weights(mask: torch.Tensor, decay: float | None = 4.0) -> torch.Tensor:
    """w = mask · exp(−j / decay) → [..., γ] float32 (no decay for ``decay`` None or ≤ 0)."""
    w = mask.to(torch.float32)
    if decay is not None and decay > 0:
        j = torch.arange(w.shape[-1], dtype=torch.float32, device=w.device)
        w = w * torch.exp(-j / float(decay))
    return w


def eagle3_loss_weights(valid: torch.Tensor, step_decay: float = 0.8,
                        row_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Eagle3: w [B, K] = valid · step_decay^k / row_norm (row_norm [B]: the row's sequence length
    T for the reference's per-sequence ``local_mean``; None: 1). Pair with den = #sequences."""
    k = torch.arange(valid.shape[-1], dtype=torch.float32, device=valid.device)
    w = valid.to(torch.float32) * float(step_decay) ** k
    if row_norm is not None:
        w = w / row_norm.to(torch.float32)[:, None]
    return w


def ce_per_token(logq: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """−log q_j(label_j): logq [B, γ, V_d], label [B, γ] (−1 → 0) → [B, γ]."""
    ce = -logq.gather(-1, label.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(label >= 0, ce, torch.zeros_like(ce))


def l1_per_token(logq: torch.Tensor, p: torch.Tensor, p_out: torch.Tensor | None = None) -> torch.Tensor:
    """‖q_j − p_j‖₁ with the full teacher: Σ_slots |q − p| + p_out → [B, γ]."""
    l1 = (logq.exp() - p).abs().sum(-1)
    return l1 if p_out is None else l1 + p_out


def l1_per_token_topk(logq: torch.Tensor, p_slots: torch.Tensor, p_top: torch.Tensor) -> torch.Tensor:
    """Upper bound of ‖q_j − p_j‖₁ from the teacher's top-k (p_slots, p_top [B, γ, k]) → [B, γ]:
    Σ_topk-in-vocab |p − q| + (p's top-k mass outside the draft vocabulary) + (1 − Σ p_top)
    + (1 − Σ q over the top-k): the rest of p and of q taken as disjoint. Exact when k = V."""
    inside = p_slots >= 0  # [B, γ, k]
    q_top = logq.gather(-1, p_slots.clamp_min(0)).exp() * inside  # [B, γ, k]
    p_in = p_top * inside
    p_rest = (1.0 - p_in.sum(-1)).clamp_min(0)  # outside the draft vocab or outside the top-k
    return (p_in - q_top).abs().sum(-1) + p_rest + (1.0 - q_top.sum(-1)).clamp_min(0)


def accept_rate(l1: torch.Tensor) -> torch.Tensor:
    """α = clamp(1 − L1/2, 0, 1) (= Σ_v min(p, q), 1 − TV) → same shape."""
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


def bce_per_token(conf_logits: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """BCE-with-logits(c_j, α_j.detach()) → [B, γ] (float32)."""
    return F.binary_cross_entropy_with_logits(conf_logits.float(), alpha.detach().float(), reduction="none")


def soft_ce_per_token(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """−Σ_slots p log q (full teacher; slots with p = 0 add nothing even where q = 0) → [B, γ].
    With a reduced vocabulary the teacher's mass outside it is dropped (q is 0 there)."""
    return -torch.where(p > 0, p * logq, torch.zeros_like(logq)).sum(-1)


def soft_ce_per_token_topk(logq: torch.Tensor, p_slots: torch.Tensor, p_top: torch.Tensor) -> torch.Tensor:
    """−Σ_k p_k log q(slot_k) over the teacher's in-vocabulary top-k → [B, γ]."""
    inside = p_slots >= 0
    return -(logq.gather(-1, p_slots.clamp_min(0)) * p_top * inside).sum(-1)


def weighted(per_token: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """num = Σ w·ℓ (a scalar; w = 0 positions add exactly 0 even where ℓ is not finite)."""
    return torch.where(weight > 0, per_token * weight, torch.zeros_like(per_token)).sum()


def normalise(num: torch.Tensor, den: torch.Tensor | float) -> torch.Tensor:
    """The reference's loss term num / (den + 1e-6)."""
    return num / (den + DEN_EPS)


def _teacher_terms(logq: torch.Tensor, p: torch.Tensor | None, p_out: torch.Tensor | None,
                   p_slots: torch.Tensor | None, p_top: torch.Tensor | None) -> torch.Tensor:
    if p is not None:
        return l1_per_token(logq, p, p_out)
    if p_slots is None or p_top is None:
        raise ValueError("no teacher: give p (full vocabulary) or p_slots / p_top (top-k)")
    return l1_per_token_topk(logq, p_slots, p_top)


def block_terms(
    logq: torch.Tensor,
    label: torch.Tensor,
    weight: torch.Tensor,
    conf_logits: torch.Tensor | None = None,
    *,
    p: torch.Tensor | None = None,
    p_out: torch.Tensor | None = None,
    p_slots: torch.Tensor | None = None,
    p_top: torch.Tensor | None = None,
    lambda_ce: float = 0.1,
    lambda_l1: float = 0.9,
    lambda_conf: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DSpark / DFlash: (Σ_terms λ·num — backpropagate it, then scale by 1/(den_global + 1e-6) —,
    nums, per-token). ``nums`` holds ``ce``, ``l1``, ``conf`` (each Σ w·ℓ, detached; ``conf`` only
    with a confidence head) and ``den`` = Σ w; ``per_token`` holds ``ce``, ``l1``, ``alpha``,
    ``bce`` [B, γ] (detached). Terms with λ = 0 still appear in ``nums`` (monitoring; the
    reference reports 0 for them) but add nothing to the loss."""
    ce = ce_per_token(logq, label)  # [B, γ]
    l1 = _teacher_terms(logq, p, p_out, p_slots, p_top)  # [B, γ]
    alpha = accept_rate(l1)  # [B, γ]
    nums = {"ce": weighted(ce, weight), "l1": weighted(l1, weight)}
    total = lambda_ce * nums["ce"] + lambda_l1 * nums["l1"]
    per = {"ce": ce.detach(), "l1": l1.detach(), "alpha": alpha.detach()}
    if conf_logits is not None:
        bce = bce_per_token(conf_logits, alpha)
        nums["conf"] = weighted(bce, weight)
        total = total + lambda_conf * nums["conf"]
        per["bce"] = bce.detach()
    out = {k: v.detach() for k, v in nums.items()}
    out["den"] = weight.sum().detach()
    return total, out, per


def eagle3_terms(
    logq: torch.Tensor,
    weight: torch.Tensor,
    *,
    p: torch.Tensor | None = None,
    p_out: torch.Tensor | None = None,
    p_slots: torch.Tensor | None = None,
    p_top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Eagle3: (num = Σ w·soft-CE to backpropagate, {"soft_ce": num, "l1": Σ w·L1} detached,
    per-token {"soft_ce", "l1", "alpha"}). ``weight`` from :func:`eagle3_loss_weights`; the den
    (number of sequences) is the caller's."""
    if p is not None:
        sce = soft_ce_per_token(logq, p)
    elif p_slots is not None and p_top is not None:
        sce = soft_ce_per_token_topk(logq, p_slots, p_top)
    else:
        raise ValueError("no teacher: give p (full vocabulary) or p_slots / p_top (top-k)")
    with torch.no_grad():
        l1 = _teacher_terms(logq, p, p_out, p_slots, p_top)
    num = weighted(sce, weight)
    return num, {"soft_ce": num.detach(), "l1": weighted(l1, weight)}, {
        "soft_ce": sce.detach(), "l1": l1, "alpha": accept_rate(l1)}


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
