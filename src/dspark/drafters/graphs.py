"""A drafter's graphs: thin ``nn.Module`` wrappers that take and return explicit tensors.

Each wrapper reuses the drafter's own modules (draft layers, norms, heads). The PyTorch drafters
run them directly (:class:`~dspark.drafters.loop.TorchRunner`, ``live=True``: the target's
embedding and LM head are read from the drafter at call time) and the exporter traces them to ONNX
(``live=False``: the embedding and LM head are *baked in* as fp32 initializers; the exported files
are bound to that target and the manifest records their sha256). The per-request bookkeeping
(context caches, padding, sampling) is in :mod:`dspark.drafters.loop`, the same for every runner.

Symbols: L draft layers, H_kv key/value heads, hd head dim, d hidden size, V vocabulary, F = m·d
the concatenated target features, r the head's rank. Dynamic axes (names used in the ONNX files,
the manifest and the TensorRT profiles): ``batch`` requests, ``block`` γ, ``past`` padded context
length, ``new`` new context positions.

DSpark / DFlash (``BlockDrafter``)
    context   features [new, F], positions [new]                       → ctx_k, ctx_v [L, H_kv, new, hd]
    backbone  anchor_ids [batch], positions [batch, block],
              ctx_k, ctx_v [L, batch, H_kv, past, hd], ctx_mask [batch, past]
                                                                        → h [batch, block, d],
                                                                          base_logits [batch, block, V]
    head      prev_ids [batch], h_j [batch, d], base_logits_j [batch, V] (+ state [batch, r], RNN)
              (DSpark only)                                             → logits [batch, V]
                                                                          (+ confidence_logit [batch])
                                                                          (+ state_out [batch, r])
Eagle3 (both layouts; ``feats`` is h_t: the fused feature or the previous step's output)
    fuse      features [new, F]                                          → fused [new, d]
    context   token_ids [new], feats [new, d], positions [new]            → ctx_k, ctx_v [1, H_kv, new, hd]
              (a causal layer's K/V of a position need no past: packed over requests like DSpark's)
    step      token_ids [batch, new], feats [batch, new, d], positions [batch, new],
              ctx_k, ctx_v [1, batch, H_kv, past, hd], ctx_mask [batch, past]
              (new = 1: one step)                                       → out [batch, new, d],
                                                                          k_new, v_new [1, batch, H_kv, new, hd],
                                                                          logits [batch, new, V]
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GraphSpec", "graph_specs", "block_graph_specs", "autoregressive_graph_specs"]


class _LiveTarget(nn.Module):
    """The drafter's bound target embedding / LM head, read at call time (PyTorch runner)."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        object.__setattr__(self, "drafter", drafter)  # not a submodule: no parameter is shared twice

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.embed(ids)  # [..., d] in the drafter's dtype

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(h)  # [..., V_d]


def _target(drafter: Any, live: bool) -> nn.Module:
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


def _hd(t: torch.Tensor) -> torch.Tensor:
    """A no-op reshape that makes the exported graph declare its last dim (head dim, rank)
    statically; the rotary concat / chunk otherwise leave it unnamed in the inferred shape."""
    return t.reshape(*t.shape[:-1], int(t.shape[-1]))


class BlockContextGraph(nn.Module):
    """KV injection for all draft layers over packed new context positions (any requests)."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.fuse, self.fuse_norm, self.layers = drafter.fuse, drafter.fuse_norm, drafter.layers

    def forward(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.fuse_norm(self.fuse(features.to(self.fuse.weight.dtype)))[None]  # [1, new, d]
        pos = positions[None]  # [1, new]
        ks, vs = [], []
        for layer in self.layers:
            k, v = layer.context_kv(ctx, pos)  # [1, H_kv, new, hd]
            ks.append(k[0])
            vs.append(v[0])
        return _hd(torch.stack(ks)), _hd(torch.stack(vs))  # [L, H_kv, new, hd] each


class BackboneGraph(nn.Module):
    """The block forward: [anchor, MASK × (γ−1)] through every draft layer, final norm, W_lm."""

    def __init__(self, drafter: Any, live: bool = False) -> None:
        super().__init__()
        self.layers, self.norm = drafter.layers, drafter.norm
        self.live = live
        if live:  # read at call time: the target binding or training may change it
            object.__setattr__(self, "drafter", drafter)
        else:  # a constant of the exported graph (the reference's frozen target-embedding row,
            # or a pre-reference drafter's learned vector)
            self.register_buffer("mask_embedding", drafter.mask_vector().detach().clone(), persistent=False)
        self.target = _target(drafter, live)

    def forward(
        self,
        anchor_ids: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, γ]
        ctx_k: torch.Tensor,  # [L, B, H_kv, P, hd]
        ctx_v: torch.Tensor,  # [L, B, H_kv, P, hd]
        ctx_mask: torch.Tensor,  # [B, P] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.target.embed(anchor_ids)  # [B, d]
        mask_embedding = self.drafter.mask_vector() if self.live else self.mask_embedding  # [d]
        # Slot 0 of each row holds the anchor, the others the mask embedding; written with the
        # positions so that the block length stays a dynamic axis.
        first = (positions == positions[:, :1])[..., None]  # [B, γ, 1]
        x = torch.where(first, emb[:, None, :], mask_embedding)  # [B, γ, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, ctx_k[i], ctx_v[i], ctx_mask)
        h = self.norm(x)  # [B, γ, d]
        return h, self.target.logits(h)  # [B, γ, d], [B, γ, V]


def head_is_stateful(head: Any) -> bool:
    """Whether a sequential head carries a state [R, r] from step to step (the RNN head)."""
    return bool(getattr(head, "stateful", getattr(head, "name", None) == "rnn"))


class HeadStepGraph(nn.Module):
    """One sequential-head step (+ the confidence head): Ũ_j = U_j + b(x̂_{j−1}, h_j)."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.head, self.confidence_head = drafter.head, drafter.confidence_head
        self.stateful = head_is_stateful(drafter.head)

    def forward(self, prev_ids: torch.Tensor, h_j: torch.Tensor, base_logits_j: torch.Tensor,
                state: torch.Tensor | None = None):
        logits, s = self.head.step(prev_ids, h_j, base_logits_j, state)
        outs = [logits]  # [B, V]
        if self.confidence_head is not None:
            outs.append(self.confidence_head(h_j, self.head.prev_embedding(prev_ids)))  # [B]
        if self.stateful:
            outs.append(_hd(s))  # [B, r]
        return tuple(outs)


def _reference_eagle3(drafter: Any) -> bool:
    """The reference Eagle3 layout (``fc`` + :class:`~dspark.drafters.eagle3.Eagle3Layer`), not
    eagle3-fused (``fuse`` + ``in_proj`` + a DraftLayer)."""
    return hasattr(drafter, "fc")


class Eagle3FuseGraph(nn.Module):
    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.fuse = drafter.fc if _reference_eagle3(drafter) else drafter.fuse

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fuse(features.to(self.fuse.weight.dtype))  # [new, d]


class Eagle3ContextGraph(nn.Module):
    """K/V of new context positions for Eagle3's cache, packed over requests.

    In a causal layer the K/V of a position depend only on that position's input (token
    embedding + fused feature), not on the attention over earlier positions, so context
    ingestion needs no past K/V and any positions of any requests can share one call.
    """

    def __init__(self, drafter: Any, live: bool = False) -> None:
        super().__init__()
        self.reference = _reference_eagle3(drafter)
        self.in_proj = None if self.reference else drafter.in_proj
        self.layer = drafter.layer
        self.target = _target(drafter, live)

    def forward(self, token_ids, feats, positions):  # [new], [new, d], [new]
        emb = self.target.embed(token_ids)  # [new, d]
        if self.reference:
            k, v = self.layer.kv(emb[None], feats[None], positions[None])  # [1, H_kv, new, hd]
            return _hd(k), _hd(v)
        x = self.in_proj(torch.cat([emb, feats], dim=-1))[None]  # [1, new, d]
        k, v = self.layer.context_kv(self.layer.input_norm(x), positions[None])  # [1, H_kv, new, hd]
        return _hd(k), _hd(v)


class Eagle3StepGraph(nn.Module):
    """One autoregressive step of Eagle3's causal layer for a batch: layer, final norm, W_lm."""

    def __init__(self, drafter: Any, live: bool = False) -> None:
        super().__init__()
        self.reference = _reference_eagle3(drafter)
        self.in_proj = None if self.reference else drafter.in_proj
        self.layer, self.norm = drafter.layer, drafter.norm
        self.target = _target(drafter, live)

    def forward(self, token_ids, feats, positions, ctx_k, ctx_v, ctx_mask):
        emb = self.target.embed(token_ids)  # [B, new, d]
        if self.reference:
            out, k, v = self.layer(emb, feats, positions, ctx_k[0], ctx_v[0], ctx_mask)
        else:
            x = self.in_proj(torch.cat([emb, feats], dim=-1))  # [B, new, d]
            out, k, v = self.layer(x, positions, ctx_k[0], ctx_v[0], ctx_mask, causal=True, return_kv=True)
        logits = self.target.logits(self.norm(out))  # [B, new, V]
        return out, _hd(k)[None], _hd(v)[None], logits  # k, v: [1, B, H_kv, new, hd]


# --------------------------------------------------------------------------------------------
# What gets exported, per drafter kind
# --------------------------------------------------------------------------------------------


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


def _examples(drafter: Any):  # noqa: ANN202
    """Sizes and a seeded randn for example inputs (sizes chosen pairwise distinct)."""
    c = drafter.config
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    mask = torch.tensor([[True, True, False], [True, True, True]])  # [B, P]
    return c, c.layer, 2, 5, 3, gen, randn, mask


def autoregressive_graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """Eagle3's graphs (``fuse``, ``context``, ``step``), with example inputs for tracing."""
    c, s, B, new, P, gen, randn, mask = _examples(drafter)
    d, Hkv, hd, V = s.hidden_size, s.num_kv_heads, s.head_dim, c.vocab_size
    step_inputs = ("token_ids", "feats", "positions", "ctx_k", "ctx_v", "ctx_mask")
    example = (torch.randint(0, V, (B, 1), generator=gen), randn(B, 1, d),
               torch.tensor([[P], [P + 1]]), randn(1, B, Hkv, P, hd), randn(1, B, Hkv, P, hd), mask)
    return [
        GraphSpec("fuse", "fuse the captured target features of new context positions",
                  Eagle3FuseGraph(drafter), ("features",), ("fused",),
                  {"features": {0: "new"}, "fused": {0: "new"}},
                  (randn(new, len(c.target_layer_ids) * d),)),
        GraphSpec("context", "K/V of new context positions (token + fused feature) for the cache",
                  Eagle3ContextGraph(drafter, live), ("token_ids", "feats", "positions"), ("ctx_k", "ctx_v"),
                  {"token_ids": {0: "new"}, "feats": {0: "new"}, "positions": {0: "new"},
                   "ctx_k": {2: "new"}, "ctx_v": {2: "new"}},
                  (torch.randint(0, V, (new,), generator=gen), randn(new, d), torch.arange(2, 2 + new)),
                  bakes_target_weights=True),
        GraphSpec("step", "one autoregressive drafting step (γ per round): layer, norm, LM head",
                  Eagle3StepGraph(drafter, live), step_inputs, ("out", "k_new", "v_new", "logits"),
                  {"token_ids": {0: "batch", 1: "new"}, "feats": {0: "batch", 1: "new"},
                   "positions": {0: "batch", 1: "new"}, "ctx_k": {1: "batch", 3: "past"},
                   "ctx_v": {1: "batch", 3: "past"}, "ctx_mask": {0: "batch", 1: "past"},
                   "k_new": {1: "batch", 3: "new"}, "v_new": {1: "batch", 3: "new"},
                   "out": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"}},
                  example, bakes_target_weights=True),
    ]


def block_graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """DSpark's / DFlash's graphs (``context``, ``backbone``, ``head`` with a sequential head)."""
    c, s, B, new, P, gen, randn, mask = _examples(drafter)
    d, Hkv, hd, V, g = s.hidden_size, s.num_kv_heads, s.head_dim, c.vocab_size, c.gamma
    F_in = len(c.target_layer_ids) * d
    specs = [
        GraphSpec("context", "KV injection: fuse new context features and project every layer's K/V",
                  BlockContextGraph(drafter), ("features", "positions"), ("ctx_k", "ctx_v"),
                  {"features": {0: "new"}, "positions": {0: "new"}, "ctx_k": {2: "new"}, "ctx_v": {2: "new"}},
                  (randn(new, F_in), torch.arange(2, 2 + new))),
        GraphSpec("backbone", "the parallel block forward: draft layers, final norm, base logits",
                  BackboneGraph(drafter, live), ("anchor_ids", "positions", "ctx_k", "ctx_v", "ctx_mask"),
                  ("h", "base_logits"),
                  {"anchor_ids": {0: "batch"}, "positions": {0: "batch", 1: "block"},
                   "ctx_k": {1: "batch", 3: "past"}, "ctx_v": {1: "batch", 3: "past"},
                   "ctx_mask": {0: "batch", 1: "past"}, "h": {0: "batch", 1: "block"},
                   "base_logits": {0: "batch", 1: "block"}},
                  (torch.randint(0, V, (B,), generator=gen), torch.arange(P, P + g)[None].repeat(B, 1),
                   randn(c.num_layers, B, Hkv, P, hd), randn(c.num_layers, B, Hkv, P, hd), mask),
                  bakes_target_weights=True),
    ]
    if drafter.head is not None:
        graph = HeadStepGraph(drafter)
        inputs = ["prev_ids", "h_j", "base_logits_j"]
        outputs = ["logits"]
        Vd = drafter.draft_size  # the head works in draft slots (V_d = V without a reduced vocabulary)
        example = [torch.randint(0, Vd, (B,), generator=gen), randn(B, d), randn(B, Vd)]
        axes = {"prev_ids": {0: "batch"}, "h_j": {0: "batch"}, "base_logits_j": {0: "batch"},
                "logits": {0: "batch"}}
        if drafter.confidence_head is not None:
            outputs.append("confidence_logit")
            axes["confidence_logit"] = {0: "batch"}
        if graph.stateful:
            inputs.append("state")
            outputs.append("state_out")
            example.append(randn(B, c.rank))
            axes.update(state={0: "batch"}, state_out={0: "batch"})
        specs.append(GraphSpec("head", "one sequential-head step (+ confidence), γ per round",
                               graph, tuple(inputs), tuple(outputs), axes, tuple(example)))
    return specs


def graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """The graphs of a bound drafter (its kind's), with example inputs for tracing."""
    return drafter.graph_specs(drafter, live=live)
