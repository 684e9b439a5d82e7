"""The calibrator JSON format: its error class, the fit record and the dump/load helpers.

The format itself is described once, in :mod:`dspark.calibration`; the calibrators in
:mod:`dspark.calibration.temperature` and :mod:`dspark.calibration.sts` write and read it through
these helpers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import field, frozen

from dspark import serialization

__all__ = ["FORMAT", "FORMAT_VERSION", "CalibratorFormatError", "FitInfo"]

FORMAT = "dspark.calibrator"
FORMAT_VERSION = 1


class CalibratorFormatError(ValueError):
    """A calibrator file or dict is corrupt, of an unknown kind, or misses a field."""


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
        return serialization.to_dict(self, nan_as_none=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str) -> FitInfo:
        try:
            return cls(**{a.name: data[a.name] for a in cls.__attrs_attrs__})
        except KeyError as err:
            raise CalibratorFormatError(f"{origin}: field 'fit.{err.args[0]}' is missing") from err
        except (TypeError, ValueError) as err:
            raise CalibratorFormatError(f"{origin}: field 'fit' is malformed: {err}") from err


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def dump(calibrator: Any, temperatures: list[float], gamma: int | None, options: dict) -> dict:
    """The JSON object of ``calibrator`` (see :mod:`dspark.calibration` for the fields)."""
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


def save(calibrator: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibrator.to_dict(), indent=2, allow_nan=False) + "\n")


# --------------------------------------------------------------------------------------------
# Reading (``origin`` names the file or "<dict>" in every error message)
# --------------------------------------------------------------------------------------------


def require(data: Mapping[str, Any], key: str, origin: str) -> Any:
    if key not in data:
        raise CalibratorFormatError(f"{origin}: field {key!r} is missing")
    return data[key]


def load_fit(data: Mapping[str, Any], origin: str) -> FitInfo | None:
    fit = data.get("fit")
    if fit is None:
        return None
    if not isinstance(fit, Mapping):
        raise CalibratorFormatError(f"{origin}: field 'fit' must be an object or null")
    return FitInfo.from_dict(fit, origin)


def load_temperatures(data: Mapping[str, Any], origin: str) -> tuple[float, ...]:
    temps = require(data, "temperatures", origin)
    if not isinstance(temps, list) or not all(
        isinstance(t, (int, float)) and not isinstance(t, bool) for t in temps
    ):
        raise CalibratorFormatError(f"{origin}: field 'temperatures' must be a list of numbers")
    return tuple(float(t) for t in temps)


def load_options(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    options = data.get("options") or {}
    if not isinstance(options, Mapping):
        raise CalibratorFormatError(f"{origin}: field 'options' must be an object")
    return dict(options)


def construct(cls: type, origin: str, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, its validation errors re-raised as :class:`CalibratorFormatError`."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise CalibratorFormatError(f"{origin}: invalid {cls.name!r} calibrator: {err}") from err
