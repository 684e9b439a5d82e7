"""dspark.serialization: attrs instances ↔ JSON-ready dicts."""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from attrs import define, field, frozen

from dspark.serialization import from_dict, to_dict


@frozen
class _Inner:
    a: int
    b: tuple[float, ...] = ()


@define
class _Outer:
    name: str
    values: tuple[tuple[int, float], ...]
    tensor: torch.Tensor
    array: np.ndarray
    score: float = math.nan
    inner: list[_Inner] = field(factory=list)
    _private: int = 0


def _outer() -> _Outer:
    return _Outer("x", ((1, 0.5), (2, math.nan)), torch.tensor([[1.0, 2.0]]), np.arange(3),
                  inner=[_Inner(1, (0.25, math.nan))], private=4)


def test_to_dict_is_json_ready_in_field_order():
    d = to_dict(_outer())
    assert list(d) == ["name", "values", "tensor", "array", "score", "inner", "_private"]
    assert d["values"] == [[1, 0.5], [2, d["values"][1][1]]] and math.isnan(d["values"][1][1])
    assert d["tensor"] == [[1.0, 2.0]] and d["array"] == [0, 1, 2]
    assert type(d["array"][0]) is int
    assert d["inner"][0]["a"] == 1 and isinstance(d["inner"][0]["b"], list)
    json.dumps(d)  # NaN allowed by default


def test_nan_as_none_and_exclude():
    d = to_dict(_outer(), exclude=("tensor", "array"), nan_as_none=True)
    assert "tensor" not in d and "array" not in d
    assert d["score"] is None and d["values"][1][1] is None and d["inner"][0]["b"] == [0.25, None]
    json.dumps(d, allow_nan=False)


def test_from_dict_takes_fields_by_name_keeps_defaults_and_ignores_other_keys():
    data = {"a": 3, "unknown": 1}
    assert from_dict(_Inner, data) == _Inner(3)
    assert from_dict(_Inner, data, b=(1.0,)) == _Inner(3, (1.0,))
    outer = from_dict(_Outer, to_dict(_outer()), inner=[_Inner(2)])
    assert outer.inner == [_Inner(2)] and outer._private == 4
