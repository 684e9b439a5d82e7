"""Sequential temperature scaling (STS, one temperature per position) and STS with a per-position
bias: the calibrators fitted position by position, j = 1..γ, on the survival ECE.

Terms (z, c_j, a_j) and the JSON format are defined in :mod:`dspark.calibration`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from attrs import field, frozen

from dspark import serialization
from dspark.calibration.fitting import check_logits, fit_data, fit_info, sts_bias_search, sts_search
from dspark.calibration.format import (
    CalibratorFormatError,
    FitInfo,
    construct,
    dump,
    load_fit,
    load_options,
    load_temperatures,
    require,
    save,
)
from dspark.calibration.temperature import positive_finite, positive_int
from dspark.metrics import survival_labels, verified_mask

__all__ = ["STSBiasCalibrator", "STSCalibrator"]


def _temperatures(_inst: object, _attr: object, value: tuple[float, ...]) -> None:
    bad = [t for t in value if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"temperatures must be finite and > 0, got {bad}")


def _float_tuple(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


# --------------------------------------------------------------------------------------------
# Sequential temperature scaling
# --------------------------------------------------------------------------------------------


def _leading(values: tuple[float, ...], z: torch.Tensor, cls_name: str, title: str) -> torch.Tensor:
    """The first γ' per-position ``values`` of a fitted calibrator, for logits z [R, γ'] → [γ']."""
    g = z.shape[1]
    if not values:
        raise RuntimeError(f"{cls_name} is not fitted: call fit(...) or load_calibrator(...)")
    if g > len(values):
        raise ValueError(
            f"confidence_logits have γ'={g} positions but this {title} calibrator was fitted for "
            f"γ={len(values)}; refit it on blocks of at least {g} positions"
        )
    return torch.tensor(values[:g], dtype=z.dtype, device=z.device)


def _fit_sequentially(
    z: torch.Tensor,
    acc: torch.Tensor,
    ver: torch.Tensor | None,
    search: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
    step: Callable[[torch.Tensor, Any], torch.Tensor],
    first: Any,
    what: str,
) -> list[Any]:
    """Per-position parameters fitted in order j = 1..γ (STS, STS + bias).

    Position j's parameters are ``search(prefix [M], z_j [M], y_j [M])`` over the M rows whose
    position j was verified, where prefix = Π_{i<j} c_i under the parameters already fitted and
    ``step(z_j [N], params) -> c_j [N]``; y_j are the survival labels. A position without verified
    rows reuses the previous parameters (``first`` at position 1), with a warning.
    """
    n, gamma = z.shape
    labels, _ = survival_labels(acc, gamma, ver)  # [N, γ]
    mask = verified_mask(acc, gamma, ver)  # [N, γ]
    params: list[Any] = []
    empty: list[int] = []
    prefix = torch.ones(n, dtype=torch.float64)  # [N] Π_{i<j} c_i
    for k in range(gamma):
        m = mask[:, k]
        if m.any():
            params.append(search(prefix[m], z[m, k], labels[m, k].to(torch.float64)))
        else:  # nothing to fit: carry the last parameters forward
            params.append(params[-1] if params else first)
            empty.append(k + 1)
        prefix = prefix * step(z[:, k], params[-1])
    if empty:
        warnings.warn(f"{what}: no verified rows at positions {empty}; each reuses the previous one", stacklevel=3)
    return params


def _sts_temperatures(data: Mapping[str, Any], origin: str) -> tuple[float, ...]:
    """The per-position temperatures of an STS-family file, checked against its 'gamma'."""
    temps = load_temperatures(data, origin)
    gamma = require(data, "gamma", origin)
    if gamma != (len(temps) or None):
        raise CalibratorFormatError(
            f"{origin}: field 'gamma' is {gamma!r} but 'temperatures' holds {len(temps)} values"
        )
    return temps


@frozen
class STSCalibrator:
    """Sequential temperature scaling (docs/concepts.md §3): c_j = σ(z_j / T_j), one T per position.

    For j = 1..γ in order, T_j minimises the survival ECE of Π_{i≤j} σ(z_i / T_i) against
    [accepted ≥ j] on rows whose position j was verified, T_{<j} fixed. ECE jumps as
    predictions cross bin edges, so the search is a log-spaced grid over [t_min, t_max]
    followed by ``refine_steps`` finer grids around the best point; ECEs within
    ``ece_tolerance`` count as ties, broken by the lower Brier score (a proper, smooth score).

    ``calibrate`` accepts any block of γ' ≤ γ positions (using T_1..T_γ') and refuses longer ones.
    """

    name: ClassVar[str] = "sts"
    positionwise: ClassVar[bool] = True  # c_j reads z_j alone: a prefix calibrates alone
    temperatures: tuple[float, ...] = field(
        default=(), converter=_float_tuple, validator=_temperatures
    )
    n_bins: int = field(default=15, validator=positive_int)
    t_min: float = field(default=0.05, converter=float, validator=positive_finite)
    t_max: float = field(default=20.0, converter=float, validator=positive_finite)
    grid_size: int = field(default=161, validator=positive_int)
    refine_steps: int = field(default=2, validator=attrs.validators.ge(0))
    ece_tolerance: float = field(default=1e-4, converter=float, validator=attrs.validators.ge(0.0))
    fit_info: FitInfo | None = None

    @property
    def gamma(self) -> int:
        """Positions this calibrator covers (0 when unfitted)."""
        return len(self.temperatures)

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        z = check_logits(confidence_logits)  # [R, γ']
        return torch.sigmoid(z / _leading(self.temperatures, z, "STSCalibrator", "STS"))

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> STSCalibrator:
        z, acc, ver = fit_data(confidence_logits, accepted, verified)
        lo, hi = math.log(self.t_min), math.log(self.t_max)
        grid = torch.exp(torch.linspace(lo, hi, self.grid_size, dtype=torch.float64))  # [G]

        def search(prefix: torch.Tensor, zj: torch.Tensor, y: torch.Tensor) -> float:
            return sts_search(prefix, zj, y, grid, n_bins=self.n_bins, refine_steps=self.refine_steps,
                              ece_tolerance=self.ece_tolerance)

        temps = _fit_sequentially(z, acc, ver, search, lambda zk, t: torch.sigmoid(zk / t), 1.0, "STS")
        t_vec = torch.tensor(temps, dtype=torch.float64)
        info = fit_info(z, acc, ver, t_vec, self.n_bins, "sequential_survival_ece")
        return attrs.evolve(self, temperatures=tuple(temps), fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        opts = serialization.to_dict(self, exclude=("temperatures", "fit_info"))
        return dump(self, list(self.temperatures), self.gamma or None, opts)

    def save(self, path: str | Path) -> None:
        save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> STSCalibrator:
        return construct(
            cls,
            origin,
            temperatures=_sts_temperatures(data, origin),
            fit_info=load_fit(data, origin),
            **load_options(data, origin),
        )


# --------------------------------------------------------------------------------------------
# Sequential temperature scaling with a per-position bias
# --------------------------------------------------------------------------------------------


def _finite_floats(_inst: object, _attr: object, value: tuple[float, ...]) -> None:
    bad = [b for b in value if not math.isfinite(b)]
    if bad:
        raise ValueError(f"biases must be finite, got {bad}")


@frozen
class STSBiasCalibrator:
    """STS with a per-position bias: c_j = σ(z_j / T_j + b_j).

    Temperature scaling only sharpens or flattens the head's confidences around c = 1/2; a head
    that is over-confident at one position and under-confident at another (or shifted, from a
    different acceptance rate on the calibration prompts) needs a shift too. For j = 1..γ in
    order, (T_j, b_j) minimise the survival ECE of Π_{i≤j} σ(z_i / T_i + b_i) against
    [accepted ≥ j] on rows whose position j was verified, earlier positions fixed: a 2-D grid
    over log T ∈ [log t_min, log t_max] × b ∈ [−b_max, b_max] refined ``refine_steps`` times
    around the winner, (1, 0) always a candidate; ECEs within ``ece_tolerance`` are tie-broken
    by the lower Brier score.

    ``calibrate`` accepts any block of γ' ≤ γ positions and refuses longer ones.
    """

    name: ClassVar[str] = "sts-bias"
    positionwise: ClassVar[bool] = True  # c_j reads z_j alone: a prefix calibrates alone
    temperatures: tuple[float, ...] = field(
        default=(), converter=_float_tuple, validator=_temperatures
    )
    biases: tuple[float, ...] = field(default=(), converter=_float_tuple, validator=_finite_floats)
    n_bins: int = field(default=20, validator=positive_int)
    t_min: float = field(default=0.05, converter=float, validator=positive_finite)
    t_max: float = field(default=20.0, converter=float, validator=positive_finite)
    b_max: float = field(default=4.0, converter=float, validator=positive_finite)
    grid_size: int = field(default=41, validator=positive_int)
    refine_steps: int = field(default=2, validator=attrs.validators.ge(0))
    ece_tolerance: float = field(default=1e-4, converter=float, validator=attrs.validators.ge(0.0))
    fit_info: FitInfo | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.biases) != len(self.temperatures):
            raise ValueError(
                f"biases hold {len(self.biases)} values but temperatures {len(self.temperatures)}: "
                "one (T_j, b_j) per position"
            )

    @property
    def gamma(self) -> int:
        """Positions this calibrator covers (0 when unfitted)."""
        return len(self.temperatures)

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        z = check_logits(confidence_logits)  # [R, γ']
        t = _leading(self.temperatures, z, "STSBiasCalibrator", "STS + bias")  # [γ']
        b = _leading(self.biases, z, "STSBiasCalibrator", "STS + bias")  # [γ']
        return torch.sigmoid(z / t + b)

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> STSBiasCalibrator:
        z, acc, ver = fit_data(confidence_logits, accepted, verified)
        log_t = (math.log(self.t_min), math.log(self.t_max))

        def search(prefix: torch.Tensor, zj: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
            return sts_bias_search(prefix, zj, y, log_t, (-self.b_max, self.b_max), n_bins=self.n_bins,
                                   grid=(self.grid_size, self.grid_size), refine_steps=self.refine_steps,
                                   ece_tolerance=self.ece_tolerance)

        params = _fit_sequentially(z, acc, ver, search, lambda zk, tb: torch.sigmoid(zk / tb[0] + tb[1]),
                                   (1.0, 0.0), "STS + bias")
        temps, biases = [t for t, _ in params], [b for _, b in params]
        t_vec = torch.tensor(temps, dtype=torch.float64)
        b_vec = torch.tensor(biases, dtype=torch.float64)
        info = fit_info(z, acc, ver, t_vec, self.n_bins, "sequential_survival_ece_bias", b_vec)
        return attrs.evolve(self, temperatures=tuple(temps), biases=tuple(biases), fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        opts = serialization.to_dict(self, exclude=("temperatures", "biases", "fit_info"))
        out = dump(self, list(self.temperatures), self.gamma or None, opts)
        out["biases"] = list(self.biases)
        return out

    def save(self, path: str | Path) -> None:
        save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> STSBiasCalibrator:
        temps = _sts_temperatures(data, origin)
        biases = require(data, "biases", origin)
        if not isinstance(biases, list) or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in biases
        ):
            raise CalibratorFormatError(f"{origin}: field 'biases' must be a list of numbers")
        return construct(
            cls,
            origin,
            temperatures=temps,
            biases=tuple(biases),
            fit_info=load_fit(data, origin),
            **load_options(data, origin),
        )
