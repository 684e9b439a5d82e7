"""Scheduler: how many draft tokens of each request to verify this round."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dspark.protocols.cost_model import CostModel


@runtime_checkable
class Scheduler(Protocol):
    """Chooses prefix lengths ℓ [R] from calibrated per-step confidences c [R, γ].

    ``lengths`` gets checked inputs (c [R, γ] float in [0, 1], valid [R] int64 ≤ γ) and returns
    ℓ [R] (integers, 0 ≤ ℓ_r ≤ valid_r); the framework checks them and builds the
    :class:`~dspark.types.Schedule` (:func:`dspark.schedulers.build_schedule`; subclass
    :class:`dspark.schedulers.SchedulerBase` for a ``schedule(...)`` method that does it).

    ``lossless`` is True only when the choice is a stopping rule: whether position j is verified
    depends on c_{r,1..j} (hence on x̂_{r,<j}) and on other requests, never on c_{r,j+1..γ}.
    """

    name: str
    lossless: bool

    def lengths(
        self,
        confidence: torch.Tensor,
        valid_lengths: torch.Tensor,
        cost_model: CostModel | None = None,
    ) -> torch.Tensor: ...
