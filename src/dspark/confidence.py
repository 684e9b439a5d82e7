"""Built-in confidence models: where raw confidence logits come from.

``draft-head`` passes through the logits of the drafter's own confidence head (DSpark), falling
back to the proxy when a drafter has none. ``max-prob`` is the documented proxy for drafters without
a head (DFlash, Eagle3, n-gram): the logit of max_v softmax(Ũ_j)(v) (of q_j when a block has no
logits). It reads Ũ_j / q_j, which depend on h_j and x̂_{j-1} only, so it keeps the stopping-rule property; a proxy built from q_j(x̂_j), the probability
of the token actually drawn, would *not* (it reads x̂_j) and is deliberately not offered.
"""

from __future__ import annotations

import torch
from attrs import field, frozen

from dspark.types import DraftBlock

__all__ = ["MaxProbConfidence", "DraftHeadConfidence", "max_prob_logits"]


def max_prob_logits(q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """logit(max_v q_j(v)), clamped away from ±inf. q [R, γ, V] → [R, γ]."""
    m = q.float().amax(dim=-1).clamp(eps, 1 - eps)  # [R, γ]
    return torch.logit(m)


def _proxy_distribution(block: DraftBlock) -> torch.Tensor:
    """softmax(Ũ_j) when the block carries its logits (a greedy q is one-hot and says nothing),
    else q. Either depends on h_j and x̂_{j-1} only."""
    if block.draft_logits is not None:
        return torch.softmax(block.draft_logits.float(), dim=-1)
    return block.q


@frozen
class MaxProbConfidence:
    """Proxy confidence: the draft distribution's largest probability at each position."""

    name = "max-prob"
    eps: float = field(default=1e-6)

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        return max_prob_logits(_proxy_distribution(block), self.eps)  # [R, γ]


@frozen
class DraftHeadConfidence:
    """The drafter's own confidence head; the max-prob proxy when the block carries none."""

    name = "draft-head"

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        if block.confidence_logits is not None:
            return block.confidence_logits  # [R, γ]
        return max_prob_logits(_proxy_distribution(block))
