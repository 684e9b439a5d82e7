"""Calibrators: raw confidence logits z [R, γ] → calibrated per-step probabilities c [R, γ].

c_j = σ(z_j / T_j) is the probability that draft position j is accepted given that positions < j
were; a_j = Π_{i≤j} c_i is the prefix survival the scheduler ranks by (docs/math.md §2). A small
per-step bias compounds in a_j, so calibration is judged on survival. Terms and label masks are
defined in :mod:`dspark.metrics`.

* :class:`IdentityCalibrator` — c = σ(z), the raw confidence head.
* :class:`TemperatureCalibrator` — one T for every position, minimising the BCE of σ(z_j / T)
  against the per-step conditional labels.
* :class:`STSCalibrator` — sequential temperature scaling: for j = 1..γ in order, T_j minimises the
  survival ECE of Π_{i≤j} σ(z_i / T_i) against [accepted ≥ j], earlier T fixed.

Calibrators are frozen: ``fit`` returns a new fitted instance and leaves ``self`` untouched.

JSON format (``to_dict`` / ``save`` / :func:`load_calibrator`)::

    {"format": "dspark.calibrator", "format_version": 1,
     "name": "sts",                 # dispatch key: identity | temperature | sts
     "gamma": 7,                    # positions fitted (null: unfitted / any length)
     "temperatures": [T_1, ...],    # identity: [], temperature: [T] (shared), sts: [T_1..T_γ]
     "options": {...},              # fitting hyper-parameters
     "fit": null | {"n_samples": N, "gamma": γ, "n_labelled": [...], "n_bins": 15,
                    "objective": "...", "ece_before": [...], "ece_after": [...]}}

``ece_before`` / ``ece_after`` are per-position survival ECEs on the fitting data under the raw
σ(z) and under the fitted calibrator (``null`` where a position had no verified rows).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from attrs import field, frozen

from dspark.metrics import (
    check_rounds,
    conditional_labels,
    ece_rows,
    survival_labels,
    verified_mask,
)

__all__ = [
    "BUILTIN_CALIBRATORS",
    "CalibratorFormatError",
    "FitInfo",
    "IdentityCalibrator",
    "STSCalibrator",
    "SyntheticRounds",
    "TemperatureCalibrator",
    "load_calibrator",
    "synthetic_rounds",
]

FORMAT = "dspark.calibrator"
FORMAT_VERSION = 1


class CalibratorFormatError(ValueError):
    """A calibrator file or dict is corrupt, of an unknown kind, or misses a field."""


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _logits(value: Any, name: str = "confidence_logits") -> torch.Tensor:
    """Raw logits as a floating tensor [R, γ]; numpy arrays become tensors."""
    z = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if z.ndim != 2:
        raise ValueError(f"{name} must be 2-D [R, γ], got shape {tuple(z.shape)}")
    if z.dtype == torch.bool or z.dtype.is_complex:
        raise TypeError(f"{name} must be a real floating tensor, got {z.dtype}")
    if not z.dtype.is_floating_point:
        z = z.to(torch.float32)
    if not torch.isfinite(z).all():
        bad = int((~torch.isfinite(z)).sum())
        raise ValueError(f"{name} contains {bad} non-finite values (NaN or inf)")
    return z


def _fit_data(
    confidence_logits: Any, accepted: Any, verified: Any | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validated fitting data: z [N, γ] float64 on CPU, accepted [N], verified [N] | None."""
    z = _logits(confidence_logits).detach().to(device="cpu", dtype=torch.float64)  # [N, γ]
    n, gamma = z.shape
    if n == 0:
        raise ValueError("cannot fit a calibrator on empty data (0 rows)")
    if gamma == 0:
        raise ValueError("cannot fit a calibrator on a block of γ = 0 positions")
    acc, ver = check_rounds(accepted, gamma, verified)
    if acc.numel() != n:
        raise ValueError(
            f"accepted has {acc.numel()} rows but confidence_logits has {n} (shape {tuple(z.shape)})"
        )
    return z, acc, ver


def _temperature(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be finite and > 0, got {value!r}")


def _temperatures(_inst: object, _attr: object, value: tuple[float, ...]) -> None:
    bad = [t for t in value if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"temperatures must be finite and > 0, got {bad}")


def _positive_int(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _float_tuple(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


# --------------------------------------------------------------------------------------------
# Fit record
# --------------------------------------------------------------------------------------------


def _nan_tuple(values: Any) -> tuple[float, ...]:
    return tuple(math.nan if v is None else float(v) for v in values)


@frozen
class FitInfo:
    """What a calibrator was fitted on and how well (survival ECE per position, fitting data)."""

    n_samples: int
    gamma: int
    n_labelled: tuple[int, ...] = field(converter=lambda v: tuple(int(x) for x in v))
    n_bins: int
    objective: str
    ece_before: tuple[float, ...] = field(converter=_nan_tuple)
    ece_after: tuple[float, ...] = field(converter=_nan_tuple)

    def to_dict(self) -> dict[str, Any]:
        def clean(vs: tuple[float, ...]) -> list[float | None]:
            return [None if math.isnan(v) else v for v in vs]

        return {
            "n_samples": self.n_samples,
            "gamma": self.gamma,
            "n_labelled": list(self.n_labelled),
            "n_bins": self.n_bins,
            "objective": self.objective,
            "ece_before": clean(self.ece_before),
            "ece_after": clean(self.ece_after),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str) -> FitInfo:
        try:
            return cls(**{a.name: data[a.name] for a in cls.__attrs_attrs__})
        except KeyError as err:
            raise CalibratorFormatError(f"{origin}: field 'fit.{err.args[0]}' is missing") from err
        except (TypeError, ValueError) as err:
            raise CalibratorFormatError(f"{origin}: field 'fit' is malformed: {err}") from err


def _survival_ece(
    c: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, n_bins: int
) -> list[float]:
    """Survival ECE per position of per-step probabilities c [N, γ] on masked rows."""
    a = torch.cumprod(c, dim=1)  # [N, γ]
    out = []
    for k in range(c.shape[1]):
        m = mask[:, k]
        if not m.any():
            out.append(math.nan)
            continue
        out.append(float(ece_rows(a[m, k][None, :], labels[m, k].to(a.dtype), n_bins)[0]))
    return out


def _fit_info(
    z: torch.Tensor,
    acc: torch.Tensor,
    ver: torch.Tensor | None,
    temps: torch.Tensor,
    n_bins: int,
    objective: str,
) -> FitInfo:
    gamma = z.shape[1]
    labels, _ = survival_labels(acc, gamma, ver)
    mask = verified_mask(acc, gamma, ver)
    return FitInfo(
        n_samples=z.shape[0],
        gamma=gamma,
        n_labelled=mask.sum(dim=0).tolist(),
        n_bins=n_bins,
        objective=objective,
        ece_before=_survival_ece(torch.sigmoid(z), labels, mask, n_bins),
        ece_after=_survival_ece(torch.sigmoid(z / temps), labels, mask, n_bins),
    )


# --------------------------------------------------------------------------------------------
# Shared serialisation
# --------------------------------------------------------------------------------------------


def _dump(calibrator: Any, temperatures: list[float], gamma: int | None, options: dict) -> dict:
    info: FitInfo | None = calibrator.fit_info
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": calibrator.name,
        "gamma": gamma,
        "temperatures": temperatures,
        "options": options,
        "fit": None if info is None else info.to_dict(),
    }


def _save(calibrator: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibrator.to_dict(), indent=2, allow_nan=False) + "\n")


def _field(data: Mapping[str, Any], key: str, origin: str) -> Any:
    if key not in data:
        raise CalibratorFormatError(f"{origin}: field {key!r} is missing")
    return data[key]


def _load_fit(data: Mapping[str, Any], origin: str) -> FitInfo | None:
    fit = data.get("fit")
    if fit is None:
        return None
    if not isinstance(fit, Mapping):
        raise CalibratorFormatError(f"{origin}: field 'fit' must be an object or null")
    return FitInfo.from_dict(fit, origin)


def _load_temps(data: Mapping[str, Any], origin: str) -> tuple[float, ...]:
    temps = _field(data, "temperatures", origin)
    if not isinstance(temps, list) or not all(
        isinstance(t, (int, float)) and not isinstance(t, bool) for t in temps
    ):
        raise CalibratorFormatError(f"{origin}: field 'temperatures' must be a list of numbers")
    return tuple(float(t) for t in temps)


def _construct(cls: type, origin: str, **kwargs: Any) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise CalibratorFormatError(f"{origin}: invalid {cls.name!r} calibrator: {err}") from err


def _options(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    options = data.get("options") or {}
    if not isinstance(options, Mapping):
        raise CalibratorFormatError(f"{origin}: field 'options' must be an object")
    return dict(options)


# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


@frozen
class IdentityCalibrator:
    """c = σ(z): no calibration. Works for any γ; ``fit`` only records the raw ECE."""

    name: ClassVar[str] = "identity"
    n_bins: int = field(default=15, validator=_positive_int)
    fit_info: FitInfo | None = None

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(_logits(confidence_logits))  # [R, γ]

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> IdentityCalibrator:
        z, acc, ver = _fit_data(confidence_logits, accepted, verified)
        ones = torch.ones(z.shape[1], dtype=z.dtype)
        info = _fit_info(z, acc, ver, ones, self.n_bins, "none")
        return attrs.evolve(self, fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        gamma = None if self.fit_info is None else self.fit_info.gamma
        return _dump(self, [], gamma, {"n_bins": self.n_bins})

    def save(self, path: str | Path) -> None:
        _save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> IdentityCalibrator:
        opts = _options(data, origin)
        return _construct(
            cls, origin, n_bins=opts.get("n_bins", 15), fit_info=_load_fit(data, origin)
        )


# --------------------------------------------------------------------------------------------
# Single temperature (BCE on conditional labels)
# --------------------------------------------------------------------------------------------


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iters: int = 80) -> float:
    """Minimiser of a unimodal f on [lo, hi] by golden-section search."""
    inv_phi = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = f(d)
    return (a + b) / 2


@frozen
class TemperatureCalibrator:
    """c_j = σ(z_j / T) with one T for all positions.

    T minimises the binary cross-entropy of σ(z_j / T) against the per-step conditional labels
    (rows at risk at j: accepted ≥ j − 1 and j verified). The loss is convex in 1/T, hence
    unimodal in log T, so a golden-section search over [t_min, t_max] finds the optimum.
    Being position-agnostic, it also calibrates blocks longer than the one it was fitted on.
    """

    name: ClassVar[str] = "temperature"
    temperature: float = field(default=1.0, converter=float, validator=_temperature)
    t_min: float = field(default=0.01, converter=float, validator=_temperature)
    t_max: float = field(default=100.0, converter=float, validator=_temperature)
    n_bins: int = field(default=15, validator=_positive_int)
    fit_info: FitInfo | None = None

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        z = _logits(confidence_logits)  # [R, γ]
        return torch.sigmoid(z / self.temperature)

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> TemperatureCalibrator:
        z, acc, ver = _fit_data(confidence_logits, accepted, verified)
        labels, at_risk = conditional_labels(acc, z.shape[1], ver)  # [N, γ] each
        zs, ys = z[at_risk], labels[at_risk].to(z.dtype)  # [M]
        if zs.numel() == 0:
            raise ValueError("no verified positions at risk to fit on (every row has verified = 0)")

        def nll(log_t: float) -> float:
            return float(F.binary_cross_entropy_with_logits(zs / math.exp(log_t), ys))

        t = math.exp(_golden_min(nll, math.log(self.t_min), math.log(self.t_max)))
        temps = torch.full((z.shape[1],), t, dtype=z.dtype)
        info = _fit_info(z, acc, ver, temps, self.n_bins, "bce_conditional")
        return attrs.evolve(self, temperature=t, fit_info=info)

    def to_dict(self) -> dict[str, Any]:
        gamma = None if self.fit_info is None else self.fit_info.gamma
        opts = {"t_min": self.t_min, "t_max": self.t_max, "n_bins": self.n_bins}
        return _dump(self, [self.temperature], gamma, opts)

    def save(self, path: str | Path) -> None:
        _save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> TemperatureCalibrator:
        temps = _load_temps(data, origin)
        if len(temps) != 1:
            raise CalibratorFormatError(
                f"{origin}: field 'temperatures' must hold exactly one value for a "
                f"'temperature' calibrator, got {len(temps)}"
            )
        return _construct(
            cls,
            origin,
            temperature=temps[0],
            fit_info=_load_fit(data, origin),
            **_options(data, origin),
        )


# --------------------------------------------------------------------------------------------
# Sequential temperature scaling
# --------------------------------------------------------------------------------------------


def _grid_scores(
    prefix: torch.Tensor, zj: torch.Tensor, y: torch.Tensor, temps: torch.Tensor, n_bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Survival ECE and Brier [G] of prefix·σ(z_j / T) for each candidate T [G].

    ``prefix`` [M] = Π_{i<j} c_i, ``zj`` [M], ``y`` [M]. The grid is chunked to bound memory.
    """
    m = zj.numel()
    chunk = max(1, 4_000_000 // m)
    eces, briers = [], []
    for start in range(0, temps.numel(), chunk):
        t = temps[start : start + chunk]  # [g]
        pred = prefix[None, :] * torch.sigmoid(zj[None, :] / t[:, None])  # [g, M]
        eces.append(ece_rows(pred, y, n_bins))
        briers.append(((pred - y[None, :]) ** 2).mean(dim=1))
    return torch.cat(eces), torch.cat(briers)


def _pick(ece: torch.Tensor, brier: torch.Tensor, tol: float) -> int:
    """Index of the lowest ECE; candidates within ``tol`` of it are tie-broken by Brier."""
    tied = ece <= ece.min() + tol
    return int(torch.where(tied, brier, torch.full_like(brier, math.inf)).argmin())


@frozen
class STSCalibrator:
    """Sequential temperature scaling (docs/math.md §3): c_j = σ(z_j / T_j), one T per position.

    For j = 1..γ in order, T_j minimises the survival ECE of Π_{i≤j} σ(z_i / T_i) against
    [accepted ≥ j] on rows whose position j was verified, T_{<j} fixed. ECE jumps as
    predictions cross bin edges, so the search is a log-spaced grid over [t_min, t_max]
    followed by ``refine_steps`` finer grids around the best point; ECEs within
    ``ece_tolerance`` count as ties, broken by the lower Brier score (a proper, smooth score).

    ``calibrate`` accepts any block of γ' ≤ γ positions (using T_1..T_γ') and refuses longer ones.
    """

    name: ClassVar[str] = "sts"
    temperatures: tuple[float, ...] = field(
        default=(), converter=_float_tuple, validator=_temperatures
    )
    n_bins: int = field(default=15, validator=_positive_int)
    t_min: float = field(default=0.05, converter=float, validator=_temperature)
    t_max: float = field(default=20.0, converter=float, validator=_temperature)
    grid_size: int = field(default=161, validator=_positive_int)
    refine_steps: int = field(default=2, validator=attrs.validators.ge(0))
    ece_tolerance: float = field(default=1e-4, converter=float, validator=attrs.validators.ge(0.0))
    fit_info: FitInfo | None = None

    @property
    def gamma(self) -> int:
        """Positions this calibrator covers (0 when unfitted)."""
        return len(self.temperatures)

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        z = _logits(confidence_logits)  # [R, γ']
        g = z.shape[1]
        if not self.temperatures:
            raise RuntimeError("STSCalibrator is not fitted: call fit(...) or load_calibrator(...)")
        if g > self.gamma:
            raise ValueError(
                f"confidence_logits have γ'={g} positions but this STS calibrator was fitted for "
                f"γ={self.gamma}; refit it on blocks of at least {g} positions"
            )
        t = torch.tensor(self.temperatures[:g], dtype=z.dtype, device=z.device)  # [γ']
        return torch.sigmoid(z / t)

    def fit(
        self,
        confidence_logits: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor | None = None,
    ) -> STSCalibrator:
        z, acc, ver = _fit_data(confidence_logits, accepted, verified)
        n, gamma = z.shape
        labels, _ = survival_labels(acc, gamma, ver)  # [N, γ]
        mask = verified_mask(acc, gamma, ver)  # [N, γ]
        lo, hi = math.log(self.t_min), math.log(self.t_max)
        grid = torch.exp(torch.linspace(lo, hi, self.grid_size, dtype=torch.float64))  # [G]

        temps: list[float] = []
        empty: list[int] = []
        prefix = torch.ones(n, dtype=torch.float64)  # [N] Π_{i<j} σ(z_i / T_i)
        for k in range(gamma):
            m = mask[:, k]
            if not m.any():
                t = temps[-1] if temps else 1.0  # nothing to fit: carry the last T forward
                empty.append(k + 1)
            else:
                t = self._search(prefix[m], z[m, k], labels[m, k].to(torch.float64), grid)
            temps.append(t)
            prefix = prefix * torch.sigmoid(z[:, k] / t)

        if empty:
            warnings.warn(
                f"STS: no verified rows at positions {empty}; each reuses the previous T",
                stacklevel=2,
            )
        t_vec = torch.tensor(temps, dtype=torch.float64)
        info = _fit_info(z, acc, ver, t_vec, self.n_bins, "sequential_survival_ece")
        return attrs.evolve(self, temperatures=tuple(temps), fit_info=info)

    def _search(
        self, prefix: torch.Tensor, zj: torch.Tensor, y: torch.Tensor, grid: torch.Tensor
    ) -> float:
        """Best T_j for one position: coarse log grid, then finer grids around the winner."""
        cands = grid
        ece, brier = _grid_scores(prefix, zj, y, cands, self.n_bins)
        best = _pick(ece, brier, self.ece_tolerance)
        for _ in range(self.refine_steps):
            lo = cands[max(best - 1, 0)].log()
            hi = cands[min(best + 1, cands.numel() - 1)].log()
            fine = torch.exp(torch.linspace(float(lo), float(hi), 41, dtype=torch.float64))
            # Keep the incumbent so refinement can never make the choice worse.
            cands = torch.cat([fine, cands[best : best + 1]])
            cands, _ = torch.sort(cands)
            ece, brier = _grid_scores(prefix, zj, y, cands, self.n_bins)
            best = _pick(ece, brier, self.ece_tolerance)
        return float(cands[best])

    def to_dict(self) -> dict[str, Any]:
        opts = {
            "n_bins": self.n_bins,
            "t_min": self.t_min,
            "t_max": self.t_max,
            "grid_size": self.grid_size,
            "refine_steps": self.refine_steps,
            "ece_tolerance": self.ece_tolerance,
        }
        return _dump(self, list(self.temperatures), self.gamma or None, opts)

    def save(self, path: str | Path) -> None:
        _save(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> STSCalibrator:
        temps = _load_temps(data, origin)
        gamma = _field(data, "gamma", origin)
        if gamma != (len(temps) or None):
            raise CalibratorFormatError(
                f"{origin}: field 'gamma' is {gamma!r} but 'temperatures' holds {len(temps)} values"
            )
        return _construct(
            cls,
            origin,
            temperatures=temps,
            fit_info=_load_fit(data, origin),
            **_options(data, origin),
        )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

BUILTIN_CALIBRATORS: dict[str, type] = {
    cls.name: cls for cls in (IdentityCalibrator, TemperatureCalibrator, STSCalibrator)
}


def load_calibrator(source: str | Path | Mapping[str, Any]) -> Any:
    """Rebuild a calibrator from a file written by ``save`` or a dict from ``to_dict``.

    Dispatches on the ``"name"`` field across :data:`BUILTIN_CALIBRATORS`. Raises
    :class:`CalibratorFormatError` (a ``ValueError``) naming the file and field for corrupt JSON,
    an unknown name, or a missing/invalid field; ``FileNotFoundError`` if the file is absent.
    """
    if isinstance(source, Mapping):
        data: Any = source
        origin = "<dict>"
    elif not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"load_calibrator takes a path or a dict from to_dict(), got {type(source).__name__}"
        )
    else:
        path = Path(source)
        origin = str(path)
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CalibratorFormatError(
                f"{origin}: not a valid calibrator JSON file ({err}); expected the output of "
                f"Calibrator.save"
            ) from err
    if not isinstance(data, Mapping):
        raise CalibratorFormatError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    version = data.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CalibratorFormatError(
            f"{origin}: field 'format_version' is {version!r}; this dspark reads up to {FORMAT_VERSION}"
        )
    name = _field(data, "name", origin)
    cls = BUILTIN_CALIBRATORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CalibratorFormatError(
            f"{origin}: unknown calibrator name {name!r}; known: {sorted(BUILTIN_CALIBRATORS)}"
        )
    return cls.from_dict(data, origin)


# --------------------------------------------------------------------------------------------
# Synthetic data with known miscalibration (tests, docs)
# --------------------------------------------------------------------------------------------


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
