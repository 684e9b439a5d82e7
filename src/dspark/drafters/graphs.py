"""A drafter's graphs: thin ``nn.Module`` wrappers that take and return explicit tensors.

Each wrapper reuses the drafter's own modules (draft layers, norms, heads). The PyTorch drafters
run them directly (:class:`~dspark.drafters.loop.TorchRunner`, ``live=True``: the target's
embedding and LM head are read from the drafter at call time) and the exporter traces them to ONNX
(``live=False``: the embedding and LM head are *baked in* as fp32 initializers; the exported files
are bound to that target and the manifest records their sha256). The per-request bookkeeping
(context caches, padding, sampling) is in :mod:`dspark.drafters.loop`, the same for every runner.

This module holds what the kinds' graphs share: :class:`GraphSpec`, the target's embedding / LM
head (:func:`target_weights`) and the example inputs. The graphs themselves are each kind's:
:mod:`dspark.drafters.dflash.graphs` (``context``, ``backbone``), :mod:`dspark.drafters.dspark.graphs`
(+ ``head``), :mod:`dspark.drafters.eagle3.graphs` (``fuse``, ``context``, ``step``), each
module docstring listing their inputs and outputs.

Dynamic axes (names used in the ONNX files, the manifest and the TensorRT profiles): ``batch``
requests, ``block`` γ, ``past`` padded context length, ``new`` new context positions.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GraphSpec", "graph_specs", "target_weights", "static_last_dim", "example_inputs"]


class _LiveTarget(nn.Module):
    """The drafter's bound target embedding / LM head, read at call time (PyTorch runner)."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        object.__setattr__(self, "drafter", drafter)  # not a submodule: no parameter is shared twice

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.embed(ids)  # [..., d] in the drafter's dtype

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(h)  # [..., V_d]


def target_weights(drafter: Any, live: bool) -> nn.Module:
    """The target's embedding and LM head as a graph reads them: the drafter's bound ones at call
    time (``live``), or copies baked into the graph."""
    return _LiveTarget(drafter) if live else _TargetWeights(drafter)


class _TargetWeights(nn.Module):
    """The target's embedding and LM head as graph initializers, each stored once.

    The LM head is kept transposed, W_lmᵀ [d, V], so that ``h @ W_lmᵀ`` is a plain MatMul: a
    ``h @ W.T`` would be constant-folded into a transposed *copy* of W. With tied embeddings
    (SmolLM2, Qwen3-0.6B) the embedding is read from the same initializer (a Gather on axis 1),
    so the V×d matrix is stored once, not twice.
    """

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.tied = drafter._embed.data_ptr() == drafter._lm_head.data_ptr()
        frozen = {"requires_grad": False}
        self.lm_head_t = nn.Parameter(drafter._lm_head.detach().float().T.contiguous(), **frozen)  # [d, V]
        if not self.tied:
            self.embed_tokens = nn.Parameter(drafter._embed.detach().float(), **frozen)  # [V, d]
        vm = getattr(drafter, "vocab_map", None)  # reduced draft vocabulary: W_lm rows + bias [V_d]
        self.logit_bias = nn.Parameter(vm.bias.float(), **frozen) if vm is not None else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 → [..., d]."""
        if not self.tied:
            return F.embedding(ids, self.embed_tokens)
        cols = self.lm_head_t.index_select(1, ids.reshape(-1))  # [d, n]
        return cols.transpose(0, 1).reshape(*ids.shape, self.lm_head_t.shape[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        U = torch.matmul(h, self.lm_head_t)  # [..., V] (V_d with a reduced draft vocabulary)
        return U if self.logit_bias is None else U + self.logit_bias


def static_last_dim(t: torch.Tensor) -> torch.Tensor:
    """A no-op reshape that makes the exported graph declare its last dim (head dim, rank)
    statically; the rotary concat / chunk otherwise leave it unnamed in the inferred shape."""
    return t.reshape(*t.shape[:-1], int(t.shape[-1]))


@attrs.frozen
class GraphSpec:
    """One graph: its wrapper, I/O names, dynamic axes and example inputs for tracing."""

    name: str
    purpose: str
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    example: tuple[torch.Tensor, ...]
    bakes_target_weights: bool = False

    @property
    def file(self) -> str:
        return f"{self.name}.onnx"


def example_inputs(drafter: Any):  # noqa: ANN202
    """Sizes and a seeded randn for example inputs (sizes chosen pairwise distinct): (config,
    layer shape, B = 2 requests, new = 5 context positions, P = 3 past positions, the generator,
    randn(*shape), ctx_mask [B, P])."""
    c = drafter.config
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    mask = torch.tensor([[True, True, False], [True, True, True]])  # [B, P]
    return c, c.layer, 2, 5, 3, gen, randn, mask


def graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """The graphs of a bound drafter (its kind's), with example inputs for tracing."""
    return drafter.graph_specs(drafter, live=live)
