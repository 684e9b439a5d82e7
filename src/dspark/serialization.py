"""attrs instances ↔ JSON-ready dicts, for classes whose JSON form is their fields as they are.

A class whose JSON differs from its fields — renamed keys, a format envelope, optional fields
left out, validation with file-and-field error messages — keeps its own ``to_dict`` /
``from_dict``; these helpers are for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import attr
import attrs
import numpy as np
import torch

__all__ = ["from_dict", "to_dict"]

T = TypeVar("T")


def to_dict(inst: Any, *, exclude: Collection[str] = (), nan_as_none: bool = False) -> dict[str, Any]:
    """``attrs.asdict(inst)`` with JSON-ready values, in field order.

    Tuples become lists, nested attrs instances dicts, tensors and numpy values (nested) lists
    or Python scalars (``tolist``). Fields named in ``exclude`` are left out; with
    ``nan_as_none`` a float NaN becomes ``None`` (JSON has no NaN).
    """

    def value(_inst: Any, _attr: Any, v: Any) -> Any:
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
            v = v.tolist()
        if nan_as_none and isinstance(v, float) and math.isnan(v):
            return None
        return v

    # attr.asdict, not attrs.asdict: only the former can turn nested tuples into lists.
    return attr.asdict(
        inst,
        filter=lambda a, _v: a.name not in exclude,
        retain_collection_types=False,
        value_serializer=value,
    )


def from_dict(cls: type[T], data: Mapping[str, Any], **converted: Any) -> T:
    """``cls`` from a dict of its fields (the output of :func:`to_dict`).

    Each init field is taken from ``data`` by name — absent ones keep their defaults, other keys
    are ignored — and ``converted`` supplies or overrides the fields that need conversion (nested
    records, tensors), keyed like the constructor's arguments.
    """
    kwargs = {a.alias: data[a.name] for a in attrs.fields(cls) if a.init and a.name in data}
    return cls(**{**kwargs, **converted})
