"""DFlash's graphs: the parallel backbone every block drafter (DFlash, DSpark) runs.

Symbols: L draft layers, H_kv key/value heads, hd head dim, d hidden size, V vocabulary (V_d with
a reduced draft vocabulary), F = m·d the concatenated target features; dynamic axes as in
:mod:`dspark.drafters.graphs`.

    context   features [new, F], positions [new]                       → ctx_k, ctx_v [L, H_kv, new, hd]
    backbone  anchor_ids [batch], positions [batch, block],
              ctx_k, ctx_v [L, batch, H_kv, past, hd], ctx_mask [batch, past]
                                                                        → h [batch, block, d],
                                                                          base_logits [batch, block, V]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.drafters.graphs import GraphSpec, example_inputs, static_last_dim, target_weights

__all__ = ["BlockContextGraph", "BackboneGraph", "block_graph_specs"]


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
        return static_last_dim(torch.stack(ks)), static_last_dim(torch.stack(vs))  # [L, H_kv, new, hd] each


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
        self.target = target_weights(drafter, live)

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


def block_graph_specs(drafter: Any, live: bool = False, examples: tuple | None = None) -> list[GraphSpec]:
    """The parallel backbone's graphs (``context``, ``backbone``), with example inputs for tracing
    (drawn from ``examples``, :func:`~dspark.drafters.graphs.example_inputs`, when a kind adds
    graphs of its own after these)."""
    c, s, B, new, P, gen, randn, mask = examples or example_inputs(drafter)
    d, Hkv, hd, V, g = s.hidden_size, s.num_kv_heads, s.head_dim, c.vocab_size, c.gamma
    F_in = len(c.target_layer_ids) * d
    return [
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
