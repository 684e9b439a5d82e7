"""DSpark's drafting round: DFlash's block round (:func:`dspark.drafters.dflash.round.draft_block`)
with γ sequential-head steps between the backbone and the draws.

x̂_j ~ softmax(Ũ_j) with Ũ_j = U_j + b(x̂_{j−1}, h_j), and the confidence logit of step j read
from (h_j, x̂_{j−1}); terms as in :mod:`dspark.drafters.loop`, r the head's rank.
"""

from __future__ import annotations

import torch

from dspark.drafters.dflash.round import draft_block
from dspark.drafters.loop import DraftingLoop
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["dspark_round", "HeadSteps", "ENDED_LOGIT"]

#: the confidence logit of a step a survival floor left out (σ ≈ 1e-13; finite, so calibrators stay finite)
ENDED_LOGIT = -30.0


class HeadSteps:
    """One round's sequential-head steps through the ``head`` graph: the RNN head's state [R, r]
    carried between steps, the confidence logits collected, and where each request's draft ends."""

    def __init__(self, loop: DraftingLoop, context: DraftContext, dtype: torch.dtype) -> None:
        s = loop.spec
        R = len(context.request_ids)
        self.loop = loop
        self.state = torch.zeros(R, s.rank, device=loop.device, dtype=dtype) if s.stateful_head else None
        self.conf: list[torch.Tensor] = []
        # what may end a request's draft after a step, both read from the confidence logits so far:
        # the opt-in survival floor (DraftingLoop.survival_floor) on Π σ(confidence logit), and the
        # round's schedule (DraftContext.stop, dspark.round.schedule_stop)
        self.floor = loop.survival_floor if s.confidence else None
        self.stop = context.stop if s.confidence else None
        self.ends = self.floor is not None or self.stop is not None
        self.survival = torch.ones(R)
        # where each draft ends (γ: not yet); a list, as the few small tensor ops a step would
        # otherwise add cost as much as the head step they save
        self.cut = [s.gamma] * R

    def __call__(self, prev: torch.Tensor, h_j: torch.Tensor, U_j: torch.Tensor) -> torch.Tensor:
        """x̂_{j−1} slots [R], h_j [R, d], U_j [R, V_d] → Ũ_j [R, V_d]."""
        loop = self.loop
        inputs = {"prev_ids": prev.to(loop.device), "h_j": h_j.contiguous(), "base_logits_j": U_j.contiguous()}
        if self.state is not None:
            inputs["state"] = self.state
        step = loop.runner.run("head", inputs)
        if loop.spec.confidence:
            self.conf.append(step["confidence_logit"])  # [R], brought to the CPU with the round
            if self.ends:
                self._end_drafts()
        if self.state is not None:
            self.state = step["state_out"]
        return step["logits"]

    def _end_drafts(self) -> None:
        """A request's draft ends at step j (x̂_j undrawn, j − 1 drafts valid) once its survival
        falls below the floor, or the round's schedule verifies no position from j on. Both are
        stopping rules (they read x̂_{<j} and h_j, never x̂_j), so lossless like any verify length."""
        j, gamma = len(self.conf) - 1, self.loop.spec.gamma  # this step, from 0: the drafts before it stay valid
        ended = [False] * len(self.cut)
        if self.floor is not None:
            self.survival = self.survival * torch.sigmoid(self.conf[-1].float().cpu())
            ended = (self.survival < self.floor).tolist()
        if self.stop is not None:
            stopped = self.stop(torch.stack(self.conf, 1).float().cpu()).tolist()  # [R, j + 1] → [R]
            ended = [e or s for e, s in zip(ended, stopped)]
        self.cut = [j if e and c == gamma else c for e, c in zip(ended, self.cut)]

    @property
    def done(self) -> bool:
        """Every request's draft has ended: the round draws no further token."""
        return self.ends and all(c < self.loop.spec.gamma for c in self.cut)

    def cut_lengths(self, valid: torch.Tensor) -> torch.Tensor:
        """The valid lengths [R], cut where each request's draft ended."""
        return torch.minimum(valid, torch.tensor(self.cut)) if self.ends else valid

    def confidence_logits(self) -> torch.Tensor | None:
        """[R, γ] on the CPU, None without a confidence head; the steps left out after every draft
        ended hold :data:`ENDED_LOGIT` (beyond every valid length)."""
        if not self.conf:
            return None
        z = torch.stack(self.conf, 1).float().cpu()
        missing = self.loop.spec.gamma - z.shape[1]
        return torch.cat([z, z.new_full((z.shape[0], missing), ENDED_LOGIT)], 1) if missing else z


def dspark_round(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
    """DSpark: ingest new context, one parallel backbone call, γ sequential-head steps and draws
    (without a head, DFlash's round)."""
    return draft_block(loop, context, feats, HeadSteps if loop.spec.head is not None else None)
