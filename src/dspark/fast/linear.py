"""A linear layer whose CPU weight is prepacked once for the matmul library.

Eager ``F.linear`` on a CPU hands oneDNN a plain row-major weight, which it re-lays-out into its
blocked format on every call; for bf16 that re-layout costs more than the product itself at the
small M of a decode step. Packing once removes it (``torch.ops.mkldnn._reorder_linear_weight`` +
``_linear_pointwise``, the ops inductor's freezing pass emits for bf16 on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "can_pack", "fused"]


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be prepacked here: a bf16 CPU tensor and oneDNN available."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available())


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
    """``F.linear(x, weight, bias)``; with ``pack`` (and :func:`can_pack`) through a oneDNN-packed
    copy of the weight outside ``torch.compile``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False) -> None:
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias
        self.packed = None
        if pack and can_pack(self.weight):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
