"""Cost models: the hardware's verification speed SPS(B) and the batch B a schedule costs.

Two built-ins satisfy :class:`dspark.protocols.CostModel` (docs/math.md §4):

* :class:`SPSTableCostModel` (``"sps-table"``): measured step times from an :class:`SPSProfile`,
  interpolated linearly or as a staircase, because real curves have CUDA-graph buckets (§4).
* :class:`RooflineCostModel` (``"roofline"``): an analytic memory/compute roofline, with presets
  for NVIDIA data-centre GPUs.

Both own the engine's *accounting*: ``"packed"`` engines verify B = Σ_r (1 + ℓ_r) tokens,
``"padded"`` ones (HF batch with padding) pay B = R · (1 + max ℓ).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
from attrs import field, frozen
from attrs.validators import in_

__all__ = [
    "ACCOUNTINGS",
    "GPU_PRESETS",
    "GPUSpec",
    "ProfileError",
    "RooflineCostModel",
    "SPSProfile",
    "SPSTableCostModel",
    "admission_batch_sizes",
    "batch_overhead",
    "batch_size",
    "default_profile_path",
    "round_seconds",
    "roofline_step_seconds",
    "table_step_seconds",
]

ACCOUNTINGS = ("packed", "padded")
INTERPOLATIONS = ("linear", "step")
EXTRAPOLATIONS = ("linear", "clamp", "error")


class ProfileError(ValueError):
    """An SPS profile is missing a field, holds a bad value, or cannot be read."""


# --------------------------------------------------------------------------------------------
# Accounting: which B a schedule costs
# --------------------------------------------------------------------------------------------


def _int_vector(name: str, value: object, minimum: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.ndim != 1:
        raise TypeError(f"{name} must be a 1-D torch.Tensor")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if value.numel() and int(value.min()) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got min {int(value.min())}")
    return value.long()


def batch_size(lengths: torch.Tensor, accounting: str) -> int:
    """B for prefix lengths ℓ [R]: packed Σ_r (1 + ℓ_r), padded R · (1 + max ℓ)."""
    lengths = _int_vector("lengths", lengths, minimum=0)  # [R]
    num_requests = lengths.numel()
    if accounting == "packed":
        return num_requests + int(lengths.sum())
    return num_requests * (1 + int(lengths.max())) if num_requests else 0


def admission_batch_sizes(
    num_requests: int, positions: torch.Tensor, accounting: str
) -> torch.Tensor:
    """B after each of K admissions of candidates at 1-based positions [K] → int64 [K + 1].

    Entry 0 is plain decoding (B = R). Packed: each admission adds one token, B_k = R + k.
    Padded: candidates of a request arrive in position order, so max ℓ after k admissions is the
    running maximum of the positions, B_k = R · (1 + max positions[:k]).
    """
    if not isinstance(num_requests, int) or isinstance(num_requests, bool) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
    positions = _int_vector("positions", positions, minimum=1)  # [K]
    if accounting == "packed":
        return num_requests + torch.arange(positions.numel() + 1)  # [K + 1]
    longest = torch.cummax(positions, dim=0).values if positions.numel() else positions  # [K]
    longest = torch.cat([positions.new_zeros(1), longest])  # [K + 1]
    return num_requests * (1 + longest)  # [K + 1]


def batch_overhead(cost_model: Any, num_requests: int) -> float:
    """α(R) of any cost model: its ``batch_overhead_seconds(R)`` when it has one (plugin cost
    models need not), else 0."""
    fn = getattr(cost_model, "batch_overhead_seconds", None)
    return float(fn(num_requests)) if fn is not None else 0.0


def round_seconds(cost_model: Any, batch_size: int, num_requests: int) -> float:
    """A whole verification step of R requests at batch B: t(B) + α(R)."""
    return float(cost_model.step_seconds(torch.tensor([batch_size]))[0]) + batch_overhead(cost_model, num_requests)


def _batch_tensor(value: torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(value, dtype=torch.float64)
    if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
        raise ValueError("batch sizes must be finite and >= 0")
    return x


class _Accounted:
    """The protocol methods shared by every cost model; subclasses give step_seconds."""

    __slots__ = ()
    accounting: str

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sps(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Steps per second, 1 / step_seconds. [K] → [K] float64."""
        return 1.0 / self.step_seconds(batch_size)

    def batch_overhead_seconds(self, num_requests: int) -> float:
        """α(R): step time that depends on the number of requests, not on B (0 unless profiled)."""
        return 0.0

    def batch_size(self, lengths: torch.Tensor) -> int:
        """B for concrete prefix lengths ℓ [R] under this model's accounting."""
        return batch_size(lengths, self.accounting)

    def admission_batch_sizes(self, num_requests: int, positions: torch.Tensor) -> torch.Tensor:
        """B after admitting candidates at 1-based positions [K] one by one → [K + 1]."""
        return admission_batch_sizes(num_requests, positions, self.accounting)


def _check_accounting(_inst: object, attribute: Any, value: object) -> None:
    if value not in ACCOUNTINGS:
        raise ValueError(f"{attribute.name} must be 'packed' or 'padded', got {value!r}")


def _check_profile_accounting(inst: object, attribute: Any, value: object) -> None:
    try:
        _check_accounting(inst, attribute, value)
    except ValueError as err:
        raise ProfileError(str(err)) from None


# --------------------------------------------------------------------------------------------
# Measured profiles
# --------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_point(index: int, point: Mapping[str, Any]) -> tuple[Any, Any]:
    """One JSON point {"batch_size", "step_seconds" | "steps_per_second"} → (B, seconds)."""
    where = f"points[{index}]"
    unknown = set(point) - {"batch_size", "step_seconds", "steps_per_second"}
    if unknown:
        raise ProfileError(f"{where} has unknown field(s) {sorted(unknown)}")
    if "batch_size" not in point:
        raise ProfileError(f"{where}.batch_size is missing")
    has_seconds, has_rate = "step_seconds" in point, "steps_per_second" in point
    if has_seconds == has_rate:
        raise ProfileError(
            f"{where} must give exactly one of step_seconds / steps_per_second, "
            f"got {'both' if has_seconds else 'neither'}"
        )
    if has_seconds:
        return point["batch_size"], point["step_seconds"]
    rate = point["steps_per_second"]
    if not _is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ProfileError(f"{where}.steps_per_second must be a finite number > 0, got {rate!r}")
    return point["batch_size"], 1.0 / rate


def _to_points(value: object) -> tuple[tuple[Any, Any], ...]:
    """{B: seconds}, [(B, seconds)] or JSON point dicts → ((B, seconds), ...), unvalidated.

    A mapping is sorted (its order means nothing); a sequence keeps its order so that an
    unsorted file is reported rather than silently reordered.
    """
    try:
        items = sorted(value.items()) if isinstance(value, Mapping) else list(value)  # type: ignore[attr-defined]
        return tuple(
            _parse_point(i, p) if isinstance(p, Mapping) else tuple(p) for i, p in enumerate(items)
        )
    except ProfileError:
        raise
    except (TypeError, ValueError):
        raise ProfileError(
            "points must be a list of {batch_size, step_seconds} objects, (batch_size, "
            f"step_seconds) pairs or a {{batch_size: step_seconds}} mapping, got {value!r}"
        ) from None


def _check_points(_inst: object, _attr: object, points: tuple[tuple[Any, Any], ...]) -> None:
    if not points:
        raise ProfileError("points must hold at least one measured point")
    previous = 0
    for i, point in enumerate(points):
        if len(point) != 2:
            raise ProfileError(f"points[{i}] must be a (batch_size, step_seconds) pair")
        size, seconds = point
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProfileError(f"points[{i}].batch_size must be an integer >= 1, got {size!r}")
        if size == previous:
            raise ProfileError(f"points[{i}].batch_size {size} is a duplicate")
        if size < previous:
            raise ProfileError(
                f"points[{i}].batch_size {size} follows {previous}: points must be sorted by "
                "batch_size, ascending"
            )
        if not _is_number(seconds) or not math.isfinite(seconds) or seconds <= 0:
            raise ProfileError(
                f"points[{i}].step_seconds must be a finite number > 0, got {seconds!r}"
            )
        previous = size


def _nonempty_str(_inst: object, attribute: Any, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _optional_threads(_inst: object, _attr: object, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ProfileError(f"threads must be an integer >= 1 or absent, got {value!r}")


def _notes(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, str):
        raise ProfileError(f"notes must be a string, got {value!r}")


_REQUIRED_FIELDS = ("device", "model", "dtype", "date", "accounting", "points")
_OPTIONAL_FIELDS = ("threads", "notes", "batch_overhead")


def _to_overhead(value: object) -> tuple[tuple[Any, Any], ...]:
    """[{num_requests, seconds}] or [(R, seconds)] → ((R, seconds), ...), unvalidated."""
    try:
        return tuple((p["num_requests"], p["seconds"]) if isinstance(p, Mapping) else tuple(p)
                     for p in value)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError):
        raise ProfileError("batch_overhead must be a list of {num_requests, seconds} objects, got "
                           f"{value!r}") from None


def _check_overhead(_inst: object, _attr: object, points: tuple[tuple[Any, Any], ...]) -> None:
    previous = 0
    for i, point in enumerate(points):
        if len(point) != 2:
            raise ProfileError(f"batch_overhead[{i}] must be a (num_requests, seconds) pair")
        R, seconds = point
        if not isinstance(R, int) or isinstance(R, bool) or R <= previous:
            raise ProfileError(f"batch_overhead[{i}].num_requests must be an integer above {previous}, got {R!r}")
        if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise ProfileError(f"batch_overhead[{i}].seconds must be a finite number >= 0, got {seconds!r}")
        previous = R


@frozen
class SPSProfile:
    """Measured verification step times of one target on one device.

    ``points`` pairs each profiled batch size B (tokens, strictly increasing) with its step time in
    seconds; ``accounting`` says which shape B was measured as (packed or padded).
    ``batch_overhead`` (optional) pairs request counts R with α(R), the part of a step that grows
    with the number of requests rather than with B (separate KV caches, per-request bookkeeping):
    a step costs points(B) + α(R), the additive model ``dspark profile`` fits (α(1) = 0).
    """

    device: str = field(validator=_nonempty_str)
    model: str = field(validator=_nonempty_str)
    dtype: str = field(validator=_nonempty_str)
    date: str = field(validator=_nonempty_str)
    accounting: str = field(validator=_check_profile_accounting)
    points: tuple[tuple[int, float], ...] = field(converter=_to_points, validator=_check_points)
    threads: int | None = field(default=None, validator=_optional_threads)
    notes: str = field(default="", validator=_notes)
    batch_overhead: tuple[tuple[int, float], ...] = field(default=(), converter=_to_overhead,
                                                          validator=_check_overhead)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(size for size, _ in self.points)

    @property
    def step_seconds(self) -> tuple[float, ...]:
        return tuple(float(seconds) for _, seconds in self.points)

    @classmethod
    def from_json(
        cls, source: str | os.PathLike[str] | Traversable | Mapping[str, Any]
    ) -> SPSProfile:
        """Read a profile from a JSON file (path) or an already-parsed dict.

        Any defect raises :class:`ProfileError` naming the file and the field.
        """
        if isinstance(source, Mapping):
            where, data = "SPS profile", source
        elif isinstance(source, (str, os.PathLike, Traversable)):
            path = source if isinstance(source, Traversable) else Path(source)
            where = f"SPS profile {path}"
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except OSError as err:
                raise ProfileError(f"{where}: cannot read it ({err.strerror or err})") from None
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ProfileError(f"{where}: not valid JSON ({err})") from None
        else:
            raise TypeError(
                f"an SPS profile is read from a path or a dict, got {type(source).__name__}"
            )
        try:
            if not isinstance(data, Mapping):
                raise ProfileError(f"must be a JSON object, got {type(data).__name__}")
            missing = [name for name in _REQUIRED_FIELDS if name not in data]
            if missing:
                raise ProfileError(f"missing required field(s) {missing}")
            unknown = set(data) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS)
            if unknown:
                raise ProfileError(f"unknown field(s) {sorted(unknown)}")
            return cls(**data)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form read by :meth:`from_json`; optional fields only when set."""
        data: dict[str, Any] = {
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "date": self.date,
            "accounting": self.accounting,
            "points": [{"batch_size": b, "step_seconds": s} for b, s in self.points],
        }
        if self.threads is not None:
            data["threads"] = self.threads
        if self.notes:
            data["notes"] = self.notes
        if self.batch_overhead:
            data["batch_overhead"] = [{"num_requests": r, "seconds": v} for r, v in self.batch_overhead]
        return data

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def default_profile_path() -> Traversable:
    """The shipped CPU profile: SmolLM2-135M, fp32, 2-core EPYC (measured before the project's first release; re-profile with `dspark profile`)."""
    return resources.files("dspark") / "data" / "cpu_smollm2_fp32.json"


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
    x = _batch_tensor(batch_size)  # [K]
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


def _to_profile(value: object) -> SPSProfile:
    return value if isinstance(value, SPSProfile) else SPSProfile.from_json(value)  # type: ignore[arg-type]


@frozen
class SPSTableCostModel(_Accounted):
    """SPS(B) from a measured profile (a path, a dict or an :class:`SPSProfile`).

    ``accounting`` defaults to the profile's; override it only when the engine runs another shape
    than the one profiled.
    """

    name: ClassVar[str] = "sps-table"

    profile: SPSProfile = field(converter=_to_profile)
    interpolation: str = field(default="linear", validator=in_(INTERPOLATIONS))
    extrapolate: str = field(default="linear", validator=in_(EXTRAPOLATIONS))
    accounting: str = field(validator=_check_accounting)
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
        """Seconds per verification step at each B. [K] → [K] float64."""
        return table_step_seconds(
            batch_size, self._sizes, self._seconds, self.interpolation, self.extrapolate
        )

    def batch_overhead_seconds(self, num_requests: int) -> float:
        """α(R) from the profile: linear between profiled R, the last value beyond (0 if none)."""
        points = self.profile.batch_overhead
        if not points:
            return 0.0
        Rs = [float(r) for r, _ in points]
        return float(np.interp(float(num_requests), Rs, [float(v) for _, v in points]))


# --------------------------------------------------------------------------------------------
# Analytic roofline
# --------------------------------------------------------------------------------------------


@frozen
class GPUSpec:
    """Published datasheet figures of one GPU."""

    name: str
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # dense BF16 FLOP/s (no 2:4 sparsity)
    source: str  # datasheet URL


GPU_PRESETS: Mapping[str, GPUSpec] = MappingProxyType(
    {
        # SXM parts. NVIDIA lists BF16 Tensor Core throughput with sparsity; dense is half.
        "h200": GPUSpec(
            name="NVIDIA H200 SXM 141GB",
            memory_bandwidth=4.8e12,
            peak_flops=989e12,
            source="https://www.nvidia.com/en-us/data-center/h200/",
        ),
        "h100": GPUSpec(
            name="NVIDIA H100 SXM 80GB",
            memory_bandwidth=3.35e12,
            peak_flops=989e12,
            source="https://www.nvidia.com/en-us/data-center/h100/",
        ),
        "a100": GPUSpec(
            name="NVIDIA A100 80GB SXM",
            memory_bandwidth=2.039e12,
            peak_flops=312e12,
            source="https://www.nvidia.com/en-us/data-center/a100/",
        ),
    }
)


def roofline_step_seconds(
    batch_size: torch.Tensor,
    *,
    weight_bytes: float,
    bytes_per_batch_token: float,
    bandwidth: float,
    flops_per_token: float,
    flops: float,
    overhead_s: float,
) -> torch.Tensor:
    """overhead + max(memory time, compute time) at each B [K] → [K] float64.

    ``bandwidth`` and ``flops`` are the achieved (efficiency-scaled) rates; memory traffic is the
    weights once per step plus ``bytes_per_batch_token`` per token of B.
    """
    x = _batch_tensor(batch_size)  # [K]
    memory = (weight_bytes + bytes_per_batch_token * x) / bandwidth  # [K]
    compute = x * flops_per_token / flops  # [K]
    return overhead_s + torch.maximum(memory, compute)


def _positive(_inst: object, attribute: Any, value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _non_negative(_inst: object, attribute: Any, value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _efficiency(_inst: object, attribute: Any, value: object) -> None:
    if not _is_number(value) or not 0 < value <= 1:  # type: ignore[operator]
        raise ValueError(f"{attribute.name} must lie in (0, 1], got {value!r}")


@frozen
class RooflineCostModel(_Accounted):
    """Step time = launch overhead + max(memory time, compute time).

    Memory time reads every weight once per step, param_bytes / (bandwidth · bandwidth_efficiency);
    compute time is B · flops_per_token / (peak_flops · flops_efficiency). Small B is memory-bound
    and flat, large B compute-bound and linear; the knee is :attr:`knee_batch_size`.

    ``kv_bytes_per_token`` × ``context_length`` × B adds KV-cache reads (default 0, off). It charges
    every token of B its own context, exact for plain decoding (R = B) and an upper bound when a
    request verifies several tokens over one shared cache.
    """

    name: ClassVar[str] = "roofline"

    num_params: float = field(validator=_positive)
    memory_bandwidth: float = field(validator=_positive)  # bytes/s
    peak_flops: float = field(validator=_positive)  # FLOP/s
    bytes_per_param: float = field(default=2.0, validator=_positive)
    flops_per_token: float = field(
        validator=_positive
    )  # default 2 · num_params (one MAC per weight)
    bandwidth_efficiency: float = field(default=1.0, validator=_efficiency)
    flops_efficiency: float = field(default=1.0, validator=_efficiency)
    launch_overhead_s: float = field(default=0.0, validator=_non_negative)
    kv_bytes_per_token: float = field(default=0.0, validator=_non_negative)
    context_length: float = field(default=0.0, validator=_non_negative)
    accounting: str = field(default="packed", validator=_check_accounting)

    @flops_per_token.default
    def _two_flops_per_param(self) -> float:
        return 2.0 * self.num_params

    @classmethod
    def for_gpu(
        cls, preset: str, num_params: float, bytes_per_param: float = 2, **options: Any
    ) -> RooflineCostModel:
        """A roofline with a preset's datasheet bandwidth and dense BF16 peak (see GPU_PRESETS)."""
        spec = GPU_PRESETS.get(preset.lower())
        if spec is None:
            raise ValueError(
                f"unknown GPU preset {preset!r}; known: {', '.join(sorted(GPU_PRESETS))}"
            )
        return cls(
            num_params=num_params,
            memory_bandwidth=spec.memory_bandwidth,
            peak_flops=spec.peak_flops,
            bytes_per_param=bytes_per_param,
            **options,
        )

    @property
    def param_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def memory_seconds(self) -> float:
        """Time to stream the weights once: the flat floor of the curve (without overhead)."""
        return self.param_bytes / (self.memory_bandwidth * self.bandwidth_efficiency)

    @property
    def knee_batch_size(self) -> float:
        """B* where compute time meets memory time; ``inf`` if KV reads keep it memory-bound."""
        compute_per_token = self.flops_per_token / (self.peak_flops * self.flops_efficiency)
        kv_per_token = (
            self.kv_bytes_per_token
            * self.context_length
            / (self.memory_bandwidth * self.bandwidth_efficiency)
        )
        if compute_per_token <= kv_per_token:
            return math.inf
        return self.memory_seconds / (compute_per_token - kv_per_token)

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Seconds per verification step at each B. [K] → [K] float64."""
        return roofline_step_seconds(
            batch_size,
            weight_bytes=self.param_bytes,
            bytes_per_batch_token=self.kv_bytes_per_token * self.context_length,
            bandwidth=self.memory_bandwidth * self.bandwidth_efficiency,
            flops_per_token=self.flops_per_token,
            flops=self.peak_flops * self.flops_efficiency,
            overhead_s=self.launch_overhead_s,
        )
