"""Scheduler: how many draft tokens of each request to verify this round."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dspark.protocols.cost_model import CostModel
from dspark.types import Schedule


@runtime_checkable
class Scheduler(Protocol):
    """Chooses prefix lengths ℓ [R] from calibrated per-step confidences c [R, γ].

    ``lossless`` is True only when the choice is a stopping rule: whether position j is verified
    depends on c_{r,1..j} (hence on x̂_{r,<j}) and on other requests, never on c_{r,j+1..γ}.
    """

    name: str
    lossless: bool

    def schedule(
        self,
        confidence: torch.Tensor,
        valid_lengths: torch.Tensor | None = None,
        cost_model: CostModel | None = None,
    ) -> Schedule: ...
