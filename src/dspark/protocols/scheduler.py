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

    Optional: ``stateless`` True when ``lengths`` reads nothing but its arguments (no clock, no
    earlier round) and changes nothing: a lossless such scheduler may be asked on a prefix of one
    request's confidences while the drafter draws, to end the draft where the schedule will
    (:func:`dspark.round.schedule_stop`). Such a scheduler may also offer ``position_rule(valid,
    cost_model)``: at one request of valid length ``valid``, a callable asked after each step j of
    the head with c_1..j [1, j] → bool, whether position j is verified, faster than ``lengths``
    (it may carry what it computed from one step to the next within the round).
    """

    name: str
    lossless: bool

    def lengths(
        self,
        confidence: torch.Tensor,
        valid_lengths: torch.Tensor,
        cost_model: CostModel | None = None,
    ) -> torch.Tensor: ...
