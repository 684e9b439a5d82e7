"""Lossless verification: modified rejection sampling over a ragged batch.

Terms, once (docs/concepts.md §6). R requests, draft block size γ, vocabulary V. For request r the
scheduler chose to verify the first ℓ_r draft tokens x̂_1..x̂_ℓ (0 ≤ ℓ_r ≤ γ; ℓ_r = 0 is plain
decoding). q_j is the draft distribution x̂_j was sampled from; p_j the target distribution at the
same position (both after the same temperature / top-k / top-p). Position j is accepted with
probability min(1, p_j(x̂_j) / q_j(x̂_j)); at the first rejection the *recovered* token is drawn
from norm(max(0, p_j − q_j)); if all ℓ_r verified tokens pass, the *bonus* token is drawn from
p_{ℓ_r+1}. The committed tokens are then distributed exactly as the target's own samples.

With one-hot p (greedy, T = 0) this reduces to: accept iff x̂_j = argmax p_j, next token =
argmax p at the first mismatch (or after the last verified position) — ``verify_greedy`` is that
special case working on argmax ids alone, without [R, γ, V] tensors.
"""

from __future__ import annotations

import torch

from dspark.sampling import Generators, sample, uniform
from dspark.types import VerifyResult

__all__ = ["verify", "verify_greedy", "residual_distribution"]


def _check_shapes(draft_tokens: torch.Tensor, lengths: torch.Tensor, n_target: int) -> None:
    R, gamma = draft_tokens.shape
    if lengths.shape != (R,):
        raise ValueError(f"lengths must have shape [R={R}], got {tuple(lengths.shape)}")
    if R and (int(lengths.min()) < 0 or int(lengths.max()) > gamma):
        raise ValueError(f"lengths ℓ_r must lie in [0, γ={gamma}], got {lengths.tolist()}")
    if n_target != gamma + 1:
        raise ValueError(
            f"the target must score γ + 1 = {gamma + 1} positions (ℓ verified + 1 bonus), "
            f"got {n_target}"
        )


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) over the last axis. p, q [..., V] → [..., V].

    Where p ≤ q everywhere (p = q), a rejection has probability 0; the result falls back to p so
    the function stays total.
    """
    r = (p - q).clamp_min(0.0)  # [..., V]
    mass = r.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def _commit(
    draft_tokens: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor
) -> torch.Tensor:
    """Committed tokens [R, γ+1]: accepted drafts, then the next token, then -1 padding."""
    R, gamma = draft_tokens.shape
    pos = torch.arange(gamma + 1)  # [γ+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((R, 1), -1)], dim=1)  # [R, γ+1]
    out = torch.where(pos[None, :] < accepted[:, None], padded, -1)  # [R, γ+1]
    return out.scatter_(1, accepted[:, None], next_tokens[:, None])


def _accepted_prefix(passed: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row. passed [R, γ] bool → [R] int64."""
    return torch.cumprod(passed.long(), dim=1).sum(dim=1)


def _prefix_mask(n: torch.Tensor, gamma: int) -> torch.Tensor:
    """[R] counts → [R, γ] bool, True at positions < n_r."""
    return torch.arange(gamma)[None, :] < n[:, None]


def verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    lengths: torch.Tensor,
    generators: Generators = None,
) -> VerifyResult:
    """Verify the first ℓ_r draft tokens of each request by modified rejection sampling.

    Args:
        draft_tokens: [R, γ] int64, x̂_j.
        q: [R, γ, V] draft distributions the tokens were sampled from.
        p: [R, γ+1, V] target distributions at positions 1..γ+1 (rows beyond ℓ_r + 1 are ignored).
        lengths: [R] int64, ℓ_r.
        generators: one generator for the batch, one per request, or None (global RNG).

    Each request consumes exactly γ + V uniforms from its generator per call,
    whatever ℓ_r is, so its random stream does not depend on the schedule.
    """
    R, gamma = draft_tokens.shape
    _check_shapes(draft_tokens, lengths, p.shape[1])
    if q.shape[:2] != (R, gamma) or q.shape[2] != p.shape[2]:
        raise ValueError(
            f"q must have shape [R={R}, γ={gamma}, V={p.shape[2]}], got {tuple(q.shape)}"
        )
    lengths = lengths.long()
    q = q.float()
    p = p.float()

    x = draft_tokens.unsqueeze(-1)  # [R, γ, 1]
    p_x = p[:, :gamma].gather(-1, x).squeeze(-1)  # [R, γ]  p_j(x̂_j)
    q_x = q.gather(-1, x).squeeze(-1)  # [R, γ]  q_j(x̂_j)
    u = uniform(R, gamma, generators)  # [R, γ]
    # u < p/q  ⇔  u·q < p : accepts with probability min(1, p/q) and never divides by zero;
    # strict so that p(x̂) = 0 is never accepted even when u = 0.
    passed = u * q_x < p_x  # [R, γ]
    verified = _prefix_mask(lengths, gamma)  # [R, γ]
    accepted = _accepted_prefix(passed & verified)  # [R]
    is_bonus = accepted == lengths  # [R]

    # Distribution of the next token: the residual at the first rejection, or p_{ℓ+1} (bonus).
    # Both live at index k = accepted (0-based), since the bonus position is ℓ = accepted.
    k = accepted[:, None, None].expand(R, 1, p.shape[2])  # [R, 1, V]
    p_k = p.gather(1, k).squeeze(1)  # [R, V]
    q_pad = torch.cat([q, q.new_zeros(R, 1, q.shape[2])], dim=1)  # [R, γ+1, V]
    q_k = q_pad.gather(1, k).squeeze(1)  # [R, V]
    next_dist = torch.where(is_bonus[:, None], p_k, residual_distribution(p_k, q_k))  # [R, V]
    next_tokens = sample(next_dist, generators)  # [R]

    return VerifyResult(
        accepted=accepted,
        accept_flags=_prefix_mask(accepted, gamma),
        next_tokens=next_tokens,
        is_bonus=is_bonus,
        committed=_commit(draft_tokens, accepted, next_tokens),
    )


def verify_greedy(
    draft_tokens: torch.Tensor, target_argmax: torch.Tensor, lengths: torch.Tensor
) -> VerifyResult:
    """Greedy (T = 0) verification from argmax ids alone.

    Args:
        draft_tokens: [R, γ] int64.
        target_argmax: [R, γ+1] int64, argmax p_j at positions 1..γ+1.
        lengths: [R] int64, ℓ_r.
    """
    R, gamma = draft_tokens.shape
    _check_shapes(draft_tokens, lengths, target_argmax.shape[1])
    lengths = lengths.long()
    verified = _prefix_mask(lengths, gamma)  # [R, γ]
    accepted = _accepted_prefix((draft_tokens == target_argmax[:, :gamma]) & verified)  # [R]
    next_tokens = target_argmax.gather(1, accepted[:, None]).squeeze(1)  # [R]
    return VerifyResult(
        accepted=accepted,
        accept_flags=_prefix_mask(accepted, gamma),
        next_tokens=next_tokens,
        is_bonus=accepted == lengths,
        committed=_commit(draft_tokens, accepted, next_tokens),
    )
