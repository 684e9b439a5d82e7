"""The ``sps-table`` cost model: step times interpolated from a measured :class:`SPSProfile`."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from typing import Any, ClassVar

import numpy as np
import torch
from attrs import evolve, field, frozen
from attrs.validators import in_

from dspark.cost_models.accounting import (
    Accounted,
    batch_tensor,
    check_accounting,
    undrafted_step_seconds,
)
from dspark.cost_models.context import context_bucket
from dspark.cost_models.fit import isotonic, monotone_grid
from dspark.cost_models.profiles import SPSProfile

__all__ = ["EXTRAPOLATIONS", "FITS", "INTERPOLATIONS", "SPSTableCostModel", "fitted_curves",
           "plain_curves", "table_step_seconds"]

INTERPOLATIONS = ("linear", "step")
EXTRAPOLATIONS = ("linear", "clamp", "error")
FITS = ("monotone", "none")

Curve = tuple[tuple[int, float], ...]


def _fit_lines(lines: list[Curve], fit: str) -> list[Curve]:
    """Curves of (x, y) points (ascending x), one per context (ascending) → the same curves, made
    monotone in x and, where every curve shares its x, across contexts (:mod:`dspark.cost_models.fit`)."""
    if fit == "none" or not any(lines):
        return lines
    xs = [tuple(x for x, _ in line) for line in lines]
    if all(x == xs[0] for x in xs):
        Y = monotone_grid(np.array([[y for _, y in line] for line in lines]))  # [C, P]
        return [tuple(zip(xs[0], row.tolist())) for row in Y]
    return [tuple(zip(x, isotonic(np.array([y for _, y in line])).tolist())) if line else line
            for x, line in zip(xs, lines)]


@functools.lru_cache(maxsize=64)
def fitted_curves(profile: SPSProfile, fit: str = "monotone") -> tuple[tuple[float | None, Curve, Curve], ...]:
    """(context, step-time points, α(R) points) per curve of ``profile``, sorted by context, as the
    ``sps-table`` model reads them. ``fit="monotone"``: the least-squares fit that never falls as
    B, R or the context grows (measured medians on a busy CPU do, by ±5–20 %, and a scheduler that
    believes them verifies too little); ``"none"``: as measured."""
    curves = profile.curves()
    alphas = [alpha for _, alpha in profile.overhead_curves()]
    points = _fit_lines([pts for _, pts in curves], fit)
    alphas = _fit_lines([tuple(a) for a in alphas], fit)
    return tuple((None if c is None else float(c), pts, alpha)
                 for (c, _), pts, alpha in zip(curves, points, alphas))


@functools.lru_cache(maxsize=64)
def plain_curves(profile: SPSProfile, fit: str = "monotone") -> tuple[tuple[int, Curve], ...]:
    """The profile's back-to-back plain steps as (context, ((R, seconds), ...)) per context,
    ascending; ``fit="monotone"`` makes them non-decreasing in R and in the context where every
    context timed the same R (:func:`fitted_curves`)."""
    by_context: dict[int, list[tuple[int, float]]] = {}
    for context, R, seconds in profile.plain_steps:
        by_context.setdefault(context, []).append((R, float(seconds)))
    contexts = sorted(by_context)
    lines = _fit_lines([tuple(sorted(by_context[c])) for c in contexts], fit)
    return tuple(zip(contexts, lines))


def _read_at_context(context: float, ctxs: list[float], at: list[torch.Tensor]) -> torch.Tensor:
    """Curves' values ``at`` [C] × [K] (contexts ``ctxs`` ascending) read at ``context``: linear
    between neighbours, the first below it, the last segment's slope beyond (never below the last)."""
    if context <= ctxs[0]:
        return at[0]
    k = next((i for i in range(1, len(ctxs)) if context <= ctxs[i]), len(ctxs) - 1)
    w = (context - ctxs[k - 1]) / (ctxs[k] - ctxs[k - 1])  # > 1 beyond the last curve
    y = at[k - 1] + w * (at[k] - at[k - 1])  # [K]
    return torch.maximum(y, at[-1]) if context > ctxs[-1] else y


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
    than the one profiled. ``fit`` (default "monotone") reads the profile's least-squares fit that
    never falls as B, R or the context grows (:func:`fitted_curves`); "none" reads it as measured.
    ``context`` (tokens of KV cache per request) selects where between the profile's curves
    measured at different contexts the step times and α(R) are read: linear in the context
    between neighbouring curves, the nearest curve below the first, the last segment's slope
    beyond the last (never below the last curve; with ``fit="monotone"`` refitted non-decreasing in
    B there). ``None``, or a profile with one curve: the
    profile's own ``points`` and ``batch_overhead``. :meth:`at_context` returns the model bound
    to a context.
    """

    name: ClassVar[str] = "sps-table"

    profile: SPSProfile = field(converter=_to_profile)
    interpolation: str = field(default="linear", validator=in_(INTERPOLATIONS))
    extrapolate: str = field(default="linear", validator=in_(EXTRAPOLATIONS))
    accounting: str = field(validator=check_accounting)
    context: float | None = field(default=None)
    fit: str = field(default="monotone", validator=in_(FITS))
    _fitted: tuple[tuple[float | None, Curve, Curve], ...] = field(init=False, repr=False, eq=False)
    # Schedulers read a handful of whole B per round, many times: step times at B = 1..largest
    # profiled B, and α per R, are computed once per (bound) model and then looked up.
    _dense: torch.Tensor = field(init=False, repr=False, eq=False)  # [max B] float64
    _alpha: dict[int, float] = field(init=False, repr=False, eq=False, factory=dict)
    _plain: dict[int, float] = field(init=False, repr=False, eq=False, factory=dict)

    @_fitted.default
    def _fit_profile(self) -> tuple[tuple[float | None, Curve, Curve], ...]:
        return fitted_curves(self.profile, self.fit)

    @_dense.default
    def _dense_table(self) -> torch.Tensor:
        top = max(b for _, pts, _ in self._fitted for b, _ in pts)
        return self._step_seconds(torch.arange(1, top + 1, dtype=torch.float64))

    @accounting.default
    def _profile_accounting(self) -> str:
        return self.profile.accounting

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
        fit: str = "monotone",
        **metadata: Any,
    ) -> SPSTableCostModel:
        """From bare points; device/model/dtype/date default to "unknown" unless given."""
        fields = {"device": "unknown", "model": "unknown", "dtype": "unknown", "date": "unknown"}
        profile = SPSProfile(points=points, accounting=accounting, **{**fields, **metadata})
        return cls(profile, interpolation=interpolation, extrapolate=extrapolate, fit=fit)

    def _main(self) -> tuple[float | None, Curve, Curve]:
        """The curve of the profile's own ``points`` (measured at ``profile.context``)."""
        main = None if self.profile.context is None else float(self.profile.context)
        return next(c for c in self._fitted if c[0] == main)

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Seconds per verification step at each B (at :attr:`context`). [K] → [K] float64."""
        x = batch_tensor(batch_size)  # [K]
        dense = self._dense
        if x.numel() and bool(((x >= 1) & (x <= dense.numel()) & (x == x.floor())).all()):
            return dense[x.long() - 1]  # the same values, read from the table of whole B
        return self._step_seconds(x)

    def _step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        def read(pts: Curve, at: torch.Tensor = batch_size) -> torch.Tensor:  # [K]
            return table_step_seconds(at, torch.tensor([b for b, _ in pts], dtype=torch.float64),
                                      torch.tensor([t for _, t in pts], dtype=torch.float64),
                                      self.interpolation, self.extrapolate)

        curves = self._fitted
        if self.context is None or len(curves) == 1:
            return read(self._main()[1])
        ctxs = [float(c) for c, _, _ in curves]  # type: ignore[arg-type]
        if self.fit == "monotone" and float(self.context) > ctxs[-1]:
            # Beyond the last curve each B continues its own slope in the context, which can bend
            # the curve down in B: read it at the profiled B and refit it monotone before reading.
            sizes = sorted({b for _, pts, _ in curves for b, _ in pts})
            grid = torch.tensor(sizes, dtype=torch.float64)  # [P]
            at = [read(pts, grid) for _, pts, _ in curves]  # C × [P]
            y = _read_at_context(float(self.context), ctxs, at)  # [P]
            y = np.maximum(isotonic(y.numpy()), at[-1].numpy())  # both monotone: so is their max
            return torch.maximum(read(tuple(zip(sizes, y.tolist()))), read(curves[-1][1]))  # B past the grid too
        return _read_at_context(float(self.context), ctxs, [read(pts) for _, pts, _ in curves])

    def at_context(self, context: float, num_requests: int | None = None) -> SPSTableCostModel:
        """This model read at ``context`` tokens of KV cache per request (rounded to 16 tokens, so
        that consecutive rounds share one bound model); itself when the profile has one curve."""
        if len(self.profile.curves()) == 1:
            return self
        return evolve(self, context=float(context_bucket(context)))

    def batch_overhead_seconds(self, num_requests: int) -> float:
        """α(R) from the profile (at :attr:`context`): linear between profiled R, the last value
        beyond (0 if none)."""
        if num_requests not in self._alpha:
            self._alpha[num_requests] = self._batch_overhead_seconds(num_requests)
        return self._alpha[num_requests]

    def plain_step_seconds(self, num_requests: int) -> float:
        """One plain decoding step of R requests (one token each) as it runs back to back, from the
        profile's ``plain_steps`` (at :attr:`context`): linear between profiled R, continuing the
        last segment's slope beyond (never falling); without them t(B₀) + α(R), the step after a
        different shape."""
        if num_requests not in self._plain:
            self._plain[num_requests] = self._plain_step_seconds(int(num_requests))
        return self._plain[num_requests]

    def _plain_step_seconds(self, num_requests: int) -> float:
        curves = plain_curves(self.profile, self.fit)
        if not curves:
            return undrafted_step_seconds(self, num_requests)

        def read(pts: Curve) -> torch.Tensor:  # [1]
            return table_step_seconds(torch.tensor([float(num_requests)]),
                                      torch.tensor([r for r, _ in pts], dtype=torch.float64),
                                      torch.tensor([t for _, t in pts], dtype=torch.float64))

        if self.context is None or len(curves) == 1:
            main = self.profile.context
            pts = next((p for c, p in curves if c == main), curves[0][1])
            return float(read(pts)[0])
        return float(_read_at_context(float(self.context), [float(c) for c, _ in curves],
                                      [read(pts) for _, pts in curves])[0])

    def _batch_overhead_seconds(self, num_requests: int) -> float:
        def read(alpha: Curve) -> torch.Tensor:  # [1]
            if not alpha:
                return torch.zeros(1, dtype=torch.float64)
            return torch.tensor([np.interp(float(num_requests), [float(r) for r, _ in alpha],
                                           [float(v) for _, v in alpha])], dtype=torch.float64)

        curves = self._fitted
        if self.context is None or len(curves) == 1:
            return float(read(self._main()[2])[0])
        y = _read_at_context(float(self.context), [float(c) for c, _, _ in curves],  # type: ignore[arg-type]
                             [read(alpha) for _, _, alpha in curves])
        return max(float(y[0]), 0.0)
