"""Rebuilding any built-in calibrator from its JSON file or dict (format: :mod:`dspark.calibration`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.calibration.format import FORMAT_VERSION, CalibratorFormatError, require
from dspark.calibration.sts import STSBiasCalibrator, STSCalibrator
from dspark.calibration.temperature import IdentityCalibrator, TemperatureCalibrator

__all__ = ["BUILTIN_CALIBRATORS", "load_calibrator"]

BUILTIN_CALIBRATORS: dict[str, type] = {
    cls.name: cls
    for cls in (IdentityCalibrator, TemperatureCalibrator, STSCalibrator, STSBiasCalibrator)
}
"""The built-in calibrators by their JSON ``"name"`` (the dispatch key of :func:`load_calibrator`)."""


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
    name = require(data, "name", origin)
    cls = BUILTIN_CALIBRATORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CalibratorFormatError(
            f"{origin}: unknown calibrator name {name!r}; known: {sorted(BUILTIN_CALIBRATORS)}"
        )
    return cls.from_dict(data, origin)
