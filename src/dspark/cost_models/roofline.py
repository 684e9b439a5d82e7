"""The ``roofline`` cost model: an analytic memory/compute roofline, with datasheet GPU presets and
the shapes of a few target models (parameters and KV-cache bytes per token)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
import torch
from attrs import field, frozen

from dspark.cost_models.accounting import Accounted, batch_tensor, check_accounting, is_number
from dspark.cost_models.context import context_bucket

__all__ = [
    "GPU_PRESETS",
    "TARGET_SHAPES",
    "GPUSpec",
    "RooflineCostModel",
    "TargetShape",
    "kv_bytes_per_token",
    "kv_bytes_per_token_from_config",
    "roofline_step_seconds",
    "target_shape",
]


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


@frozen
class TargetShape:
    """What the roofline needs of a target model: its parameter count and its KV-cache geometry."""

    name: str
    num_params: float  # counted from the config's tensor shapes (embeddings, attention, MLP, norms)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    source: str  # the model's config.json

    def kv_bytes_per_token(self, bytes_per_element: float = 2) -> float:
        """Bytes of K and V cached per token of context (bf16/fp16 by default)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_element)


TARGET_SHAPES: Mapping[str, TargetShape] = MappingProxyType(
    {
        "smollm2-135m": TargetShape(
            name="SmolLM2-135M",
            num_params=134_515_008,
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json",
        ),
        "llama-3.1-8b": TargetShape(
            name="Llama-3.1-8B",
            num_params=8_030_261_248,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        ),
        "qwen3-8b": TargetShape(
            name="Qwen3-8B",
            num_params=8_190_735_360,
            num_layers=36,
            num_kv_heads=8,
            head_dim=128,
            source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
        ),
        "llama-3.1-70b": TargetShape(
            name="Llama-3.1-70B",
            num_params=70_553_706_496,
            num_layers=80,
            num_kv_heads=8,
            head_dim=128,
            source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
        ),
    }
)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float = 2
) -> float:
    """KV-cache bytes per token of context: K and V, in every layer, for every KV head."""
    return float(2 * num_layers * num_kv_heads * head_dim * bytes_per_element)


def _config_get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def kv_bytes_per_token_from_config(config: Any, bytes_per_element: float = 2) -> float:
    """:func:`kv_bytes_per_token` of a Hugging Face config (a ``PretrainedConfig`` or its dict):
    ``num_hidden_layers``, ``num_key_value_heads`` (else ``num_attention_heads``: no GQA) and
    ``head_dim`` (else ``hidden_size / num_attention_heads``)."""
    layers = _config_get(config, "num_hidden_layers")
    heads = _config_get(config, "num_attention_heads")
    kv_heads = _config_get(config, "num_key_value_heads") or heads
    head_dim = _config_get(config, "head_dim")
    if head_dim is None and heads:
        hidden = _config_get(config, "hidden_size")
        head_dim = hidden // heads if hidden else None
    if not layers or not kv_heads or not head_dim:
        raise ValueError(
            "the config needs num_hidden_layers, num_key_value_heads or num_attention_heads, and "
            "head_dim or hidden_size"
        )
    return kv_bytes_per_token(int(layers), int(kv_heads), int(head_dim), bytes_per_element)


def target_shape(name: str) -> TargetShape:
    """The shape registered under ``name`` (case-insensitive); ValueError naming the known ones."""
    shape = TARGET_SHAPES.get(name.lower()) if isinstance(name, str) else None
    if shape is None:
        raise ValueError(f"unknown target shape {name!r}; known: {', '.join(sorted(TARGET_SHAPES))}")
    return shape


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

    ``bandwidth`` and ``flops`` are the achieved (efficiency-scaled) rates; memory traffic is
    ``weight_bytes`` once per step (the weights, plus the KV cache of a model bound to R requests)
    plus ``bytes_per_batch_token`` per token of B.
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


def _optional_count(_inst: object, attribute: Any, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be an integer >= 1 or None, got {value!r}")


def _efficiency(_inst: object, attribute: Any, value: object) -> None:
    if not is_number(value) or not 0 < value <= 1:  # type: ignore[operator]
        raise ValueError(f"{attribute.name} must lie in (0, 1], got {value!r}")


@frozen
class RooflineCostModel(Accounted):
    """Step time = launch overhead + max(memory time, compute time).

    Memory time reads every weight once per step, param_bytes / (bandwidth · bandwidth_efficiency);
    compute time is B · flops_per_token / (peak_flops · flops_efficiency). Small B is memory-bound
    and flat, large B compute-bound and linear; the knee is :attr:`knee_batch_size`.

    The attention term (off while ``kv_bytes_per_token`` is 0) adds the KV cache read per step. A
    model bound to R requests (``num_requests``, set by :meth:`at_context` as the engine and the
    simulator do each round) reads each request's cache once, whatever its number of query tokens
    (flash-attention style): R · ``context_length`` · ``kv_bytes_per_token`` bytes, constant in B.
    Unbound (``num_requests`` None) it charges every token of B its own context,
    B · ``context_length`` · ``kv_bytes_per_token``: exact for plain decoding (R = B), an upper
    bound when a request verifies several tokens over one cache. Attention FLOPs are not counted.
    :meth:`for_target` takes the parameter count and KV bytes per token from a target's shape.
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
    num_requests: int | None = field(default=None, validator=_optional_count)
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

    @classmethod
    def for_target(
        cls, gpu: str | None, target: Any, bytes_per_param: float = 2, **options: Any
    ) -> RooflineCostModel:
        """A GPU preset's roofline for a target: a :data:`TARGET_SHAPES` name (its parameter
        count and KV bytes per token) or a Hugging Face config (KV bytes per token from it; pass
        ``num_params=``). The KV cache is held at ``bytes_per_param`` per element unless
        ``kv_bytes_per_token`` is given; ``options`` override the rest (``gpu`` None: pass
        ``memory_bandwidth`` and ``peak_flops``)."""
        if isinstance(target, str):
            shape = target_shape(target)
            options.setdefault("num_params", shape.num_params)
            options.setdefault("kv_bytes_per_token", shape.kv_bytes_per_token(bytes_per_param))
        else:
            if "num_params" not in options:
                raise ValueError("a target given as a config needs num_params=")
            options.setdefault(
                "kv_bytes_per_token", kv_bytes_per_token_from_config(target, bytes_per_param)
            )
        num_params = options.pop("num_params")
        if gpu is None:
            return cls(num_params=num_params, bytes_per_param=bytes_per_param, **options)
        return cls.for_gpu(gpu, num_params=num_params, bytes_per_param=bytes_per_param, **options)

    @property
    def param_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def memory_seconds(self) -> float:
        """Time to stream the weights once: the flat floor of the curve (without overhead)."""
        return self.param_bytes / (self.memory_bandwidth * self.bandwidth_efficiency)

    @property
    def kv_bytes_per_step(self) -> float:
        """KV bytes read per step besides the per-token term: R · context · KV bytes per token
        when bound to R requests, else 0 (then every token of B reads its own context)."""
        if self.num_requests is None:
            return 0.0
        return self.num_requests * self.context_length * self.kv_bytes_per_token

    @property
    def kv_bytes_per_batch_token(self) -> float:
        """KV bytes charged per token of B: context · KV bytes per token when unbound, else 0."""
        if self.num_requests is not None:
            return 0.0
        return self.context_length * self.kv_bytes_per_token

    @property
    def knee_batch_size(self) -> float:
        """B* where compute time meets memory time; ``inf`` if KV reads keep it memory-bound."""
        bandwidth = self.memory_bandwidth * self.bandwidth_efficiency
        compute_per_token = self.flops_per_token / (self.peak_flops * self.flops_efficiency)
        kv_per_token = self.kv_bytes_per_batch_token / bandwidth
        if compute_per_token <= kv_per_token:
            return math.inf
        fixed = (self.param_bytes + self.kv_bytes_per_step) / bandwidth
        return fixed / (compute_per_token - kv_per_token)

    def at_context(self, context: float, num_requests: int | None = None) -> RooflineCostModel:
        """This model at ``context`` tokens of KV cache per request (rounded to 16 tokens) for a
        batch of ``num_requests`` requests (None: unknown, the per-token upper bound); itself when
        ``kv_bytes_per_token`` is 0."""
        if self.kv_bytes_per_token == 0.0:
            return self
        return attrs.evolve(
            self,
            context_length=float(context_bucket(context)),
            num_requests=None if num_requests is None else int(num_requests),
        )

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Seconds per verification step at each B. [K] → [K] float64."""
        return roofline_step_seconds(
            batch_size,
            weight_bytes=self.param_bytes + self.kv_bytes_per_step,
            bytes_per_batch_token=self.kv_bytes_per_batch_token,
            bandwidth=self.memory_bandwidth * self.bandwidth_efficiency,
            flops_per_token=self.flops_per_token,
            flops=self.peak_flops * self.flops_efficiency,
            overhead_s=self.launch_overhead_s,
        )
