"""Eagle3's graphs (both layouts; ``feats`` is h_t: the fused feature or the previous step's output).

Symbols: H_kv key/value heads, hd head dim, d hidden size, V vocabulary (V_d with a reduced draft
vocabulary), F = m·d the concatenated target features; dynamic axes as in
:mod:`dspark.drafters.graphs`.

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

import torch
from torch import nn

from dspark.drafters.graphs import GraphSpec, example_inputs, static_last_dim, target_weights

__all__ = ["Eagle3FuseGraph", "Eagle3ContextGraph", "Eagle3StepGraph", "autoregressive_graph_specs"]


def _reference_eagle3(drafter: Any) -> bool:
    """The reference Eagle3 layout (``fc`` + :class:`~dspark.drafters.eagle3.model.Eagle3Layer`),
    not eagle3-fused (``fuse`` + ``in_proj`` + a DraftLayer)."""
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
        self.target = target_weights(drafter, live)

    def forward(self, token_ids, feats, positions):  # [new], [new, d], [new]
        emb = self.target.embed(token_ids)  # [new, d]
        if self.reference:
            k, v = self.layer.kv(emb[None], feats[None], positions[None])  # [1, H_kv, new, hd]
            return static_last_dim(k), static_last_dim(v)
        x = self.in_proj(torch.cat([emb, feats], dim=-1))[None]  # [1, new, d]
        k, v = self.layer.context_kv(self.layer.input_norm(x), positions[None])  # [1, H_kv, new, hd]
        return static_last_dim(k), static_last_dim(v)


class Eagle3StepGraph(nn.Module):
    """One autoregressive step of Eagle3's causal layer for a batch: layer, final norm, W_lm."""

    def __init__(self, drafter: Any, live: bool = False) -> None:
        super().__init__()
        self.reference = _reference_eagle3(drafter)
        self.in_proj = None if self.reference else drafter.in_proj
        self.layer, self.norm = drafter.layer, drafter.norm
        self.target = target_weights(drafter, live)

    def forward(self, token_ids, feats, positions, ctx_k, ctx_v, ctx_mask):
        emb = self.target.embed(token_ids)  # [B, new, d]
        if self.reference:
            out, k, v = self.layer(emb, feats, positions, ctx_k[0], ctx_v[0], ctx_mask)
        else:
            x = self.in_proj(torch.cat([emb, feats], dim=-1))  # [B, new, d]
            out, k, v = self.layer(x, positions, ctx_k[0], ctx_v[0], ctx_mask, causal=True, return_kv=True)
        logits = self.target.logits(self.norm(out))  # [B, new, V]
        return out, static_last_dim(k)[None], static_last_dim(v)[None], logits  # k, v: [1, B, H_kv, new, hd]


def autoregressive_graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """Eagle3's graphs (``fuse``, ``context``, ``step``), with example inputs for tracing."""
    c, s, B, new, P, gen, randn, mask = example_inputs(drafter)
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
