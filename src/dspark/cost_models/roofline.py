"""The ``roofline`` cost model: an analytic memory/compute roofline, with datasheet GPU presets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
import torch
from attrs import field, frozen

from dspark.cost_models.accounting import Accounted, batch_tensor, check_accounting, is_number

__all__ = ["GPU_PRESETS", "GPUSpec", "RooflineCostModel", "roofline_step_seconds"]


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
    x = batch_tensor(batch_size)  # [K]
    memory = (weight_bytes + bytes_per_batch_token * x) / bandwidth  # [K]
    compute = x * flops_per_token / flops  # [K]
    return overhead_s + torch.maximum(memory, compute)


def _positive(_inst: object, attribute: Any, value: object) -> None:
    if not is_number(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _non_negative(_inst: object, attribute: Any, value: object) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _efficiency(_inst: object, attribute: Any, value: object) -> None:
    if not is_number(value) or not 0 < value <= 1:  # type: ignore[operator]
        raise ValueError(f"{attribute.name} must lie in (0, 1], got {value!r}")


@frozen
class RooflineCostModel(Accounted):
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
    accounting: str = field(default="packed", validator=check_accounting)

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

    def at_context(self, context: float, num_requests: int | None = None) -> RooflineCostModel:
        """This model with ``context_length`` = ``context`` (rounded to 16 tokens): the attention
        term reads that much KV cache per token of B (zero unless ``kv_bytes_per_token`` is set)."""
        if self.kv_bytes_per_token == 0.0:
            return self
        return attrs.evolve(self, context_length=float(16 * round(float(context) / 16)))

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
