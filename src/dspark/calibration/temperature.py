"""The calibrators with one shared temperature: identity (c = σ(z)) and a single temperature
T for all positions (c_j = σ(z_j / T)), and the field validators every built-in calibrator uses.

Terms (z, c_j, a_j) and the JSON format are defined in :mod:`dspark.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from attrs import field, frozen

from dspark import serialization
from dspark.calibration.fitting import check_logits, fit_data, fit_info, fit_temperature
from dspark.calibration.format import (
    CalibratorFormatError,
    FitInfo,
    construct,
    dump,
    load_fit,
    load_options,
    load_temperatures,
    save,
)
from dspark.metrics import conditional_labels

__all__ = ["IdentityCalibrator", "TemperatureCalibrator", "positive_finite", "positive_int"]


def positive_finite(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    """attrs validator: a temperature or a bound that must be finite and > 0."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be finite and > 0, got {value!r}")


def positive_int(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    """attrs validator: a count (bins, grid points) that must be an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


@frozen
class IdentityCalibrator:
    """c = σ(z): no calibration. Works for any γ; ``fit`` only records the raw ECE."""

    name: ClassVar[str] = "identity"
    positionwise: ClassVar[bool] = True  # c_j reads z_j alone: a prefix calibrates alone
    n_bins: int = field(default=15, validator=positive_int)
    fit_info: FitInfo | None = None

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(check_logits(confidence_logits))  # [R, γ]

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> IdentityCalibrator:
        z, acc, ver = fit_data(confidence_logits, accepted, verified)
        ones = torch.ones(z.shape[1], dtype=z.dtype)
        info = fit_info(z, acc, ver, ones, self.n_bins, "none")
        return attrs.evolve(self, fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        gamma = None if self.fit_info is None else self.fit_info.gamma
        return dump(self, [], gamma, serialization.to_dict(self, exclude=("fit_info",)))

    def save(self, path: str | Path) -> None:
        save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> IdentityCalibrator:
        opts = load_options(data, origin)
        return construct(
            cls, origin, n_bins=opts.get("n_bins", 15), fit_info=load_fit(data, origin)
        )


# --------------------------------------------------------------------------------------------
# Single temperature (BCE on conditional labels)
# --------------------------------------------------------------------------------------------


@frozen
class TemperatureCalibrator:
    """c_j = σ(z_j / T) with one T for all positions.

    T minimises the binary cross-entropy of σ(z_j / T) against the per-step conditional labels
    (rows at risk at j: accepted ≥ j − 1 and j verified). The loss is convex in 1/T, hence
    unimodal in log T, so a bounded scalar search (scipy's Brent) over [t_min, t_max] finds the
    optimum. Being position-agnostic, it also calibrates blocks longer than the one it was fitted
    on.
    """

    name: ClassVar[str] = "temperature"
    positionwise: ClassVar[bool] = True  # c_j reads z_j alone: a prefix calibrates alone
    temperature: float = field(default=1.0, converter=float, validator=positive_finite)
    t_min: float = field(default=0.01, converter=float, validator=positive_finite)
    t_max: float = field(default=100.0, converter=float, validator=positive_finite)
    n_bins: int = field(default=15, validator=positive_int)
    fit_info: FitInfo | None = None

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        z = check_logits(confidence_logits)  # [R, γ]
        return torch.sigmoid(z / self.temperature)

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> TemperatureCalibrator:
        z, acc, ver = fit_data(confidence_logits, accepted, verified)
        labels, at_risk = conditional_labels(acc, z.shape[1], ver)  # [N, γ] each
        zs, ys = z[at_risk], labels[at_risk].to(z.dtype)  # [M]
        if zs.numel() == 0:
            raise ValueError("no verified positions at risk to fit on (every row has verified = 0)")
        t = fit_temperature(zs, ys, self.t_min, self.t_max)
        temps = torch.full((z.shape[1],), t, dtype=z.dtype)
        info = fit_info(z, acc, ver, temps, self.n_bins, "bce_conditional")
        return attrs.evolve(self, temperature=t, fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        gamma = None if self.fit_info is None else self.fit_info.gamma
        opts = serialization.to_dict(self, exclude=("temperature", "fit_info"))
        return dump(self, [self.temperature], gamma, opts)

    def save(self, path: str | Path) -> None:
        save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> TemperatureCalibrator:
        temps = load_temperatures(data, origin)
        if len(temps) != 1:
            raise CalibratorFormatError(
                f"{origin}: field 'temperatures' must hold exactly one value for a "
                f"'temperature' calibrator, got {len(temps)}"
            )
        return construct(
            cls,
            origin,
            temperature=temps[0],
            fit_info=load_fit(data, origin),
            **load_options(data, origin),
        )
