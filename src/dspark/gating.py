"""The draft gate: stop drafting while drafting does not pay for itself.

The scheduler decides *after* the drafter ran, so even its ℓ = 0 schedule pays the drafting time.
At saturation (large R on a compute-bound target) the best schedule is plain decoding and the
drafter's forward is pure overhead; the paper's claim "never below plain decoding" needs the engine
to skip it. Terms: after a drafted round with R requests, the scheduler's expected committed tokens
τ̂ and verification batch B, measured drafting seconds t_d, and the cost model's step time t(B):

    speculative rate  = τ̂ / (t_d + t(B))
    plain rate        = R / t(B₀),     B₀ = the batch of ℓ = 0 for all R requests.

When plain wins (by ``margin``) the next ``backoff`` rounds skip the drafter (plain verification
through the same target; the drafter's context catches up on the next drafted round). Each
consecutive loss doubles the backoff up to ``max_backoff``; a win resets it. Skipping a round is
lossless: it is plain decoding.
"""

from __future__ import annotations

import torch
from attrs import define, field, validators

from dspark.protocols.cost_model import CostModel

__all__ = ["DraftGate", "gate_prefers_plain"]


def gate_prefers_plain(
    expected_tokens: float, batch_size: int, num_requests: int, draft_seconds: float,
    cost_model: CostModel, margin: float = 1.0,
) -> bool:
    """True when R / t(B₀) > margin · τ̂ / (t_d + t(B)) (module docstring)."""
    plain_batch = cost_model.batch_size(torch.zeros(num_requests, dtype=torch.long))
    t = cost_model.step_seconds(torch.tensor([batch_size, plain_batch])).tolist()  # [2] seconds
    speculative = expected_tokens / (draft_seconds + t[0])
    plain = num_requests / t[1]
    return plain > margin * speculative


@define
class DraftGate:
    """Stateful gate owned by one engine (see the module docstring). ``margin`` > 1 favours drafting."""

    min_backoff: int = field(default=2, validator=[validators.instance_of(int), validators.ge(1)])
    max_backoff: int = field(default=32, validator=[validators.instance_of(int), validators.ge(1)])
    margin: float = field(default=1.0, converter=float, validator=validators.gt(0.0))
    skip: int = field(default=0, init=False)  # rounds left to run without drafting
    backoff: int = field(default=0, init=False)  # the next skip length; 0 = min_backoff
    skipped_rounds: int = field(default=0, init=False)

    def should_draft(self) -> bool:
        """Call once per round; False consumes one skipped round."""
        if self.skip > 0:
            self.skip -= 1
            self.skipped_rounds += 1
            return False
        return True

    def update(self, expected_tokens: float, batch_size: int, num_requests: int, draft_seconds: float,
               cost_model: CostModel) -> bool:
        """Record a drafted round; returns True when the following rounds will skip drafting."""
        if gate_prefers_plain(expected_tokens, batch_size, num_requests, draft_seconds, cost_model,
                              self.margin):
            self.skip = self.backoff or self.min_backoff
            self.backoff = min(2 * self.skip, self.max_backoff)
            return True
        self.backoff = 0
        return False
