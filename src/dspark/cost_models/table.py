"""The ``sps-table`` cost model: step times interpolated from a measured :class:`SPSProfile`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from typing import Any, ClassVar

import numpy as np
import torch
from attrs import evolve, field, frozen
from attrs.validators import in_

from dspark.cost_models.accounting import Accounted, batch_tensor, check_accounting
from dspark.cost_models.context import context_bucket
from dspark.cost_models.profiles import SPSProfile

__all__ = ["EXTRAPOLATIONS", "INTERPOLATIONS", "SPSTableCostModel", "table_step_seconds"]

INTERPOLATIONS = ("linear", "step")
EXTRAPOLATIONS = ("linear", "clamp", "error")


def _to_profile(value: object) -> SPSProfile:
    return value if isinstance(value, SPSProfile) else SPSProfile.from_json(value)  # type: ignore[arg-type]


def table_step_seconds(
    batch_size: torch.Tensor,
    sizes: torch.Tensor,
    seconds: torch.Tensor,
    interpolation: str = "linear",
    extrapolate: str = "linear",
) -> torch.Tensor:
    """Step seconds at B [K] from measured ``sizes`` [P] (ascending integers) and ``seconds`` [P].

    Below sizes[0] the first time holds. "linear" interpolates between neighbours; "step" takes
    the time of the smallest measured size ≥ B (a CUDA-graph bucket pads up to it). Beyond
    sizes[-1], ``extrapolate`` continues the last segment's slope (never below the last time),
    clamps to the last time, or raises.
    """
    x = batch_tensor(batch_size)  # [K]
    last = sizes.numel() - 1
    hi = torch.searchsorted(sizes, x).clamp(max=last)  # [K] smallest measured size ≥ B
    if interpolation == "step":
        y = seconds[hi]  # [K]
    else:
        lo = (hi - 1).clamp(min=0)  # [K]
        # Sizes are distinct integers, so a real segment spans ≥ 1; lo == hi only below sizes[0].
        t = ((x - sizes[lo]) / (sizes[hi] - sizes[lo]).clamp(min=1.0)).clamp(0.0, 1.0)  # [K]
        y = seconds[lo] + t * (seconds[hi] - seconds[lo])  # [K]
    beyond = x > sizes[last]  # [K]
    if bool(beyond.any()):
        if extrapolate == "error":
            raise ValueError(
                f"batch size {x[beyond].max().item():g} is beyond the largest profiled batch size "
                f"{int(sizes[last])}; profile larger batches or use extrapolate='linear'/'clamp'"
            )
        tail = seconds[last].expand_as(x)  # [K]
        if extrapolate == "linear" and last > 0:
            slope = (seconds[last] - seconds[last - 1]) / (sizes[last] - sizes[last - 1])
            tail = seconds[last] + slope.clamp(min=0.0) * (x - sizes[last])  # [K]
        y = torch.where(beyond, tail, y)
    return y


@frozen
class SPSTableCostModel(Accounted):
    """SPS(B) from a measured profile (a path, a dict or an :class:`SPSProfile`).

    ``accounting`` defaults to the profile's; override it only when the engine runs another shape
    than the one profiled. ``context`` (tokens of KV cache per request) selects where between the
    profile's curves measured at different contexts the step times are read: linear in the
    context between neighbouring curves, the nearest curve below the first, the last segment's
    slope beyond the last (never below the last curve). ``None``, or a profile with one curve:
    the profile's own ``points``. :meth:`at_context` returns the model bound to a context.
    """

    name: ClassVar[str] = "sps-table"

    profile: SPSProfile = field(converter=_to_profile)
    interpolation: str = field(default="linear", validator=in_(INTERPOLATIONS))
    extrapolate: str = field(default="linear", validator=in_(EXTRAPOLATIONS))
    accounting: str = field(validator=check_accounting)
    context: float | None = field(default=None)
    _sizes: torch.Tensor = field(init=False, repr=False, eq=False)  # [P] float64
    _seconds: torch.Tensor = field(init=False, repr=False, eq=False)  # [P] float64

    @accounting.default
    def _profile_accounting(self) -> str:
        return self.profile.accounting

    @_sizes.default
    def _profile_sizes(self) -> torch.Tensor:
        return torch.tensor(self.profile.batch_sizes, dtype=torch.float64)

    @_seconds.default
    def _profile_seconds(self) -> torch.Tensor:
        return torch.tensor(self.profile.step_seconds, dtype=torch.float64)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str] | Traversable, **options: Any
    ) -> SPSTableCostModel:
        return cls(SPSProfile.from_json(path), **options)

    @classmethod
    def from_points(
        cls,
        points: Mapping[int, float] | list[Any],
        *,
        accounting: str = "packed",
        interpolation: str = "linear",
        extrapolate: str = "linear",
        **metadata: Any,
    ) -> SPSTableCostModel:
        """From bare points; device/model/dtype/date default to "unknown" unless given."""
        fields = {"device": "unknown", "model": "unknown", "dtype": "unknown", "date": "unknown"}
        profile = SPSProfile(points=points, accounting=accounting, **{**fields, **metadata})
        return cls(profile, interpolation=interpolation, extrapolate=extrapolate)

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Seconds per verification step at each B (at :attr:`context`). [K] → [K] float64."""
        curves = self.profile.curves()
        if self.context is None or len(curves) == 1:
            return table_step_seconds(
                batch_size, self._sizes, self._seconds, self.interpolation, self.extrapolate
            )
        ctxs = [float(c) for c, _ in curves]
        at = [table_step_seconds(batch_size, torch.tensor([b for b, _ in pts], dtype=torch.float64),
                                 torch.tensor([t for _, t in pts], dtype=torch.float64),
                                 self.interpolation, self.extrapolate) for _, pts in curves]  # C × [K]
        c = float(self.context)
        if c <= ctxs[0]:
            return at[0]
        k = next((i for i in range(1, len(ctxs)) if c <= ctxs[i]), len(ctxs) - 1)
        w = (c - ctxs[k - 1]) / (ctxs[k] - ctxs[k - 1])  # > 1 beyond the last curve
        y = at[k - 1] + w * (at[k] - at[k - 1])  # [K]
        return torch.maximum(y, at[-1]) if c > ctxs[-1] else y

    def at_context(self, context: float, num_requests: int | None = None) -> SPSTableCostModel:
        """This model read at ``context`` tokens of KV cache per request (rounded to 16 tokens, so
        that consecutive rounds share one bound model); itself when the profile has one curve."""
        if len(self.profile.curves()) == 1:
            return self
        return evolve(self, context=float(context_bucket(context)))

    def batch_overhead_seconds(self, num_requests: int) -> float:
        """α(R) from the profile: linear between profiled R, the last value beyond (0 if none)."""
        points = self.profile.batch_overhead
        if not points:
            return 0.0
        Rs = [float(r) for r, _ in points]
        return float(np.interp(float(num_requests), Rs, [float(v) for _, v in points]))
