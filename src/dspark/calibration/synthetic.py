"""Synthetic verification rounds with known miscalibration (tests, docs)."""

from __future__ import annotations

import torch
from attrs import frozen

__all__ = ["SyntheticRounds", "synthetic_rounds"]


@frozen
class SyntheticRounds:
    """Simulated verification rounds with known per-step acceptance probabilities."""

    logits: torch.Tensor  # [N, γ] raw confidence logits = slope · logit(c*) + bias
    accepted: torch.Tensor  # [N] int64, accepted prefix length
    true_step: torch.Tensor  # [N, γ] c*_j, the true conditional acceptance probabilities

    def take(self, index: torch.Tensor | slice) -> SyntheticRounds:
        return SyntheticRounds(self.logits[index], self.accepted[index], self.true_step[index])


def synthetic_rounds(
    n: int,
    gamma: int,
    *,
    slope: float = 2.0,
    bias: float = 0.5,
    generator: torch.Generator | None = None,
) -> SyntheticRounds:
    """Rounds whose raw confidence is over-confident by a known amount.

    A latent difficulty u ~ N(0, 1) per round and noise ε_j ~ N(0, 1) per position give the true
    step logit l_j = 2 − 0.35 (j − 1) + u + 0.75 ε_j (acceptance decays along the block) and
    c*_j = σ(l_j). Tokens pass independently with probability c*_j; the prefix breaks at the first
    failure. The raw head reports z_j = slope · l_j + bias (slope > 1: over-confident), so
    σ(z_j / slope) is perfectly calibrated when bias = 0.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    j = torch.arange(gamma, dtype=torch.float64)
    u = torch.randn(n, 1, generator=generator, dtype=torch.float64)  # [N, 1]
    eps = torch.randn(n, gamma, generator=generator, dtype=torch.float64)  # [N, γ]
    step_logit = 2.0 - 0.35 * j[None, :] + u + 0.75 * eps  # [N, γ]
    true_step = torch.sigmoid(step_logit)
    passed = torch.rand(n, gamma, generator=generator, dtype=torch.float64) < true_step
    accepted = torch.cumprod(passed.to(torch.int64), dim=1).sum(dim=1)  # [N]
    logits = (slope * step_logit + bias).to(torch.float32)
    return SyntheticRounds(logits=logits, accepted=accepted, true_step=true_step)
