"""Calibrator: raw confidence logits → calibrated per-step acceptance probabilities c_{r,j}."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Calibrator(Protocol):
    """Maps raw confidence logits [R, γ] to calibrated per-step probabilities c [R, γ].

    ``fit`` takes held-out raw logits [N, γ] and accepted prefix lengths [N] (0..γ); optional
    ``verified`` lengths [N] mark rows whose labels beyond ℓ are unknown (censored).

    Optional: ``positionwise`` True when c_{r,j} reads z_{r,j} alone and ``calibrate`` takes any
    leading γ' ≤ γ positions, so a prefix of a block's logits calibrates as the whole block would
    (:func:`dspark.round.schedule_stop`).
    """

    name: str

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor: ...

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> Calibrator: ...

    def to_dict(self) -> dict[str, Any]: ...

    def save(self, path: str | Path) -> None: ...
