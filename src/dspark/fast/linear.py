"""A linear layer whose CPU weight is prepacked once for the matmul library.

Eager ``F.linear`` on a CPU hands oneDNN a plain row-major weight, which it re-lays-out into its
blocked format on every call; for bf16 that re-layout costs more than the product itself at the
small M of a decode step. Packing once removes it (``torch.ops.mkldnn._reorder_linear_weight`` +
``_linear_pointwise``, the ops inductor's freezing pass emits for bf16 on CPU).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "bf16_packing_supported", "can_pack", "fused", "inference_linear", "packs", "route_linears"]

log = logging.getLogger(__name__)


@functools.cache
def bf16_packing_supported() -> bool:
    """Whether this CPU's oneDNN can pack and multiply bf16 weights. It cannot without AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT, e.g. on an AVX2-only CPU: there the packing op raises, so it is
    probed once on a small weight and the packed route is declined with one logged sentence."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _reorder(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError as err:
        log.info("bf16 weights are not prepacked on this CPU (%s); products run as written",
                 str(err).split("\n")[0])
        return False
    return True


def _reorder(weight: torch.Tensor) -> Any:
    """oneDNN's blocked layout of a [out, in] weight, for ``_linear_pointwise`` at batch size 1 and up."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be prepacked here: a bf16 CPU tensor, on a CPU whose oneDNN packs bf16
    (:func:`bf16_packing_supported`)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bf16_packing_supported())


def fused(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight [Σ out, in], bias or None) for several ``nn.Linear`` of the same input: one
    product reads the input once and fills the matmul kernel better than several small ones."""
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                      for m, b in zip(linears, biases)])
    return weight, bias


class Linear(nn.Module):
    """``F.linear(x, weight, bias)``; with ``pack`` (and :func:`can_pack`) through
    :func:`inference_linear`, its packed copy made here once (the first step pays nothing)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False) -> None:
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias
        self.pack = pack and can_pack(weight)
        if self.pack:
            _packed(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inference_linear(x, self.weight, self.bias) if self.pack else F.linear(x, self.weight, self.bias)


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`inference_linear` takes the packed route for these operands."""
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling() and can_pack(weight)
            and x.dtype == weight.dtype)


def _packed(weight: torch.Tensor) -> Any:
    """The oneDNN-packed copy of ``weight``, kept on the tensor itself and made again whenever the
    weight changed in place (its version counter moved)."""
    entry = getattr(weight, "_dspark_packed", None)
    if entry is None or entry[0] != weight._version:
        with torch.no_grad():
            entry = (weight._version, _reorder(weight.detach()))
        weight._dspark_packed = entry
    return entry[1]


def inference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; where no gradient is recorded and :func:`can_pack`, through
    the packed copy of ``weight`` (:func:`_packed`)."""
    if not packs(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return inference_linear(x, self.weight, self.bias)


def route_linears(module: nn.Module) -> int:
    """Send every ``nn.Linear`` of ``module`` through :func:`inference_linear` (training, fp32 and
    GPUs are unaffected: it falls back to ``F.linear`` there); returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m.forward = _routed_forward.__get__(m, nn.Linear)
            n += 1
    return n
