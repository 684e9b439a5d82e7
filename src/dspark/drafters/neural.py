"""The neural drafters: DSpark (parallel backbone + sequential head + confidence), DFlash
(backbone only) and Eagle3 (one autoregressive layer).

Terms: R requests, γ block size, V vocabulary, d hidden size, m captured target layers. For a
request whose anchor (last committed token) sits at absolute position a, the *context* is every
committed position before a; the engine hands the drafter the target's hidden states at
``target_layer_ids`` for context positions it has not seen yet (``DraftContext.features["hidden"]``,
one [n_new, m·d] tensor per request), and the drafter caches per-layer context K/V only.

DSpark / DFlash — one non-causal forward over the block [anchor, MASK × (γ−1)] at positions
a..a+γ−1 gives h_1..h_γ and base logits U_j = W_lm·norm(h_j); DSpark then runs the sequential
head Ũ_j = U_j + b(x̂_{j−1}, h_j) for j = 1..γ and draws x̂_j ~ softmax(Ũ_j) under the request's
sampling params, with confidence logits from (h_j, x̂_{j−1}); DFlash draws every x̂_j from U_j.

Eagle3 (reference layout, :mod:`dspark.drafters.eagle3`) — one causal layer whose q/k/v read
[norm(emb(x_{t+1})) ; norm(h_t)] where h_t is fc(f_t) (context) or the layer's own previous output
(drafted positions); γ causal steps. Eagle3-fused (dspark's pre-reference variant) — input at
position t is W_in[emb(x_{t+1}) ; f_t] instead.

The target's token embedding and LM head are shared and frozen: they are bound from the target
(``bind_target``) and never saved with the drafter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.graphs import autoregressive_graph_specs, block_graph_specs, head_is_stateful
from dspark.drafters.layers import DraftLayer, RMSNorm
from dspark.drafters.loop import (
    DraftingLoop,
    KVStore,
    LoopSpec,
    TorchRunner,
    autoregressive_round,
    block_round,
)
from dspark.drafters.vocab import DraftVocab, to_slots
from dspark.fast.linear import inference_linear, packs
from dspark.protocols.drafter import DraftContext
from dspark.protocols.sequential_head import TargetBoundHead
from dspark.types import DraftBlock

__all__ = ["BlockDrafter", "Eagle3FusedDrafter", "build_drafter"]


class _NeuralDrafter(nn.Module):
    """Shared plumbing: the bound target embedding / LM head, per-request caches, sampling."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.name = config.kind
        self.gamma = config.gamma
        self.vocab_size = config.vocab_size
        self.target_layer_ids = config.target_layer_ids
        self._embed: torch.Tensor | None = None  # [V, d] frozen, from the target
        self._lm_head: torch.Tensor | None = None  # [V, d] frozen, from the target
        self._loop: DraftingLoop | None = None  # built on the first draft() (see :attr:`loop`)
        # Reduced draft vocabulary: draft slot i scores target token draft_ids[i]; the last slot is
        # a placeholder (logit −inf, never drawn) that anchors outside the draft vocabulary map to.
        Vd = config.draft_vocab_size
        self.draft_size = Vd or config.vocab_size  # the V the logits, q and heads work in
        if Vd is not None:
            self.register_buffer("draft_ids", torch.arange(Vd, dtype=torch.long) % config.vocab_size)  # [V_d]
        self.vocab_map: DraftVocab | None = None  # set by bind_target
        self._lm_head_full: torch.Tensor | None = None

    # -- target binding -------------------------------------------------------------------
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> _NeuralDrafter:
        V, d = self.config.vocab_size, self.config.layer.hidden_size
        for what, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if tuple(w.shape) != (V, d):
                raise ValueError(
                    f"target {what} has shape {tuple(w.shape)}; this drafter needs [vocab {V}, hidden {d}]"
                )
        self._embed = embed_weight.detach()
        self._loop = None  # the vocabulary map may change: the next draft() starts afresh
        self._lm_head = self._lm_head_full = lm_head_weight.detach()
        if self.config.draft_vocab_size is not None:
            self.vocab_map = DraftVocab(self.draft_ids, V)
            self._lm_head = self._lm_head_full[self.draft_ids]  # [V_d, d] (placeholder row masked by bias)
        head = getattr(self, "head", None)
        if isinstance(head, TargetBoundHead):
            # A head that reuses the target's weights gets them in its own (draft-slot) order.
            embed = self._embed if self.vocab_map is None else self._embed[self.draft_ids]  # [V_d, d]
            head.bind_target(embed, self._lm_head)
        return self

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Use these V_d − 1 target tokens as the draft vocabulary (then call ``bind_target``)."""
        Vd = self.config.draft_vocab_size
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if Vd is None or token_ids.numel() != Vd - 1 or token_ids.unique().numel() != Vd - 1:
            raise ValueError(f"need {None if Vd is None else Vd - 1} distinct token ids for the draft vocabulary")
        self.draft_ids.copy_(torch.cat([token_ids, token_ids[:1]]))  # last: placeholder

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids → draft slots (identity without a reduced vocabulary)."""
        return to_slots(self.vocab_map, tokens)

    @property
    def is_bound(self) -> bool:
        return self._embed is not None and self._lm_head is not None

    def target_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound target embedding [V, d] and full LM head [V, d] (what an export bakes in)."""
        self._require_bound()
        return self._embed, self._lm_head_full

    def _require_bound(self) -> None:
        if self._embed is None or self._lm_head is None:
            raise RuntimeError("bind_target(embed, lm_head) must be called before drafting")

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self._embed).to(self.dtype)  # [..., d]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-space logits [..., V_d] (V_d = V without a reduced vocabulary)."""
        h = h.to(self._lm_head.dtype)
        # a bf16 CPU product through the LM head packed once (dspark.fast.linear), else as written
        U = inference_linear(h, self._lm_head) if packs(h, self._lm_head) else h @ self._lm_head.T
        return U if self.vocab_map is None else U + self.vocab_map.bias.to(U.dtype)

    # -- drafting: the one loop (dspark.drafters.loop) over this drafter's own modules ---------
    #: the round function and graphs of this drafter's kind (set by each subclass)
    round = staticmethod(block_round)
    graph_specs = staticmethod(block_graph_specs)

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        """The graphs an export of this drafter holds (``config``: a DrafterConfig dict)."""
        return ("context", "backbone", "head") if config.get("head") else ("context", "backbone")

    def loop_spec(self) -> LoopSpec:
        c = self.config
        head = getattr(self, "head", None)
        return LoopSpec(
            kind=c.kind, gamma=c.gamma, vocab_size=c.vocab_size, hidden_size=c.layer.hidden_size,
            target_layer_ids=tuple(c.target_layer_ids), num_layers=self._num_cached_layers(),
            num_kv_heads=c.layer.num_kv_heads, head_dim=c.layer.head_dim,
            head=c.head if head is not None else None, rank=c.rank,
            confidence=getattr(self, "confidence_head", None) is not None,
            stateful_head=head is not None and head_is_stateful(head),
            sample_from_anchor=c.sample_from_anchor, returns_hidden=self._returns_hidden,
            vocab_map=self.vocab_map)

    #: whether DraftBlock.hidden carries h (block drafters) / the per-step outputs (Eagle3)
    _returns_hidden = True

    def _num_cached_layers(self) -> int:
        return len(self.layers)

    @property
    def loop(self) -> DraftingLoop:
        if self._loop is None:
            self._loop = DraftingLoop(self.loop_spec(), TorchRunner(self), type(self).round)
        return self._loop

    @torch.inference_mode()
    def draft(self, context: DraftContext) -> DraftBlock:
        self._require_bound()
        return self.loop.draft(context)

    def release(self, request_id: str) -> None:
        if self._loop is not None:
            self._loop.release(request_id)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per part in the last draft() call."""
        return self._loop.timings if self._loop is not None else {}

    @property
    def _caches(self) -> dict[str, KVStore]:
        return self.loop.caches


class BlockDrafter(_NeuralDrafter):
    """DSpark (with ``config.head``) and DFlash (without): parallel backbone + optional head."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        s = config.layer
        m = len(config.target_layer_ids)
        self.fuse = nn.Linear(m * s.hidden_size, s.hidden_size, bias=False)
        self.fuse_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(config.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if config.mask_token_id is None:  # pre-reference variant: a learned mask vector
            self.mask_embedding = nn.Parameter(torch.zeros(s.hidden_size))
            nn.init.normal_(self.mask_embedding, std=0.02)
        self.head = None
        self.confidence_head = None
        if config.head is not None:
            from dspark.heads import HEAD_KINDS, ConfidenceHead, build_head

            if config.head in HEAD_KINDS:
                self.head = build_head(config.head, self.draft_size, s.hidden_size, config.rank)
            else:  # a plugin's head (register_sequential_heads), same factory signature
                from dspark.plugins import create

                self.head = create("sequential_heads", config.head, vocab_size=self.draft_size,
                                   hidden_size=s.hidden_size, rank=config.rank)
            if config.confidence:
                self.confidence_head = ConfidenceHead(s.hidden_size, config.rank)

    def mask_vector(self) -> torch.Tensor:
        """The embedding [d] of the block's mask slots: the target's (frozen) input embedding of
        ``mask_token_id`` as in the reference, or the learned vector of a pre-reference drafter."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        self._require_bound()
        return self._embed[self.config.mask_token_id].to(self.dtype)


class _Eagle3Loop(_NeuralDrafter):
    """The Eagle3 kinds (:class:`Eagle3FusedDrafter`, :class:`dspark.drafters.eagle3.Eagle3Drafter`):
    drafting is :func:`~dspark.drafters.loop.autoregressive_round` (per-request causal K/V cache,
    the pending feature of the last context position, γ autoregressive steps).

    A subclass provides ``_fuse(features [n, m·d]) → [n, d]``, ``_run(tokens [R, n], feats
    [R, n, d], positions [R, n], ctx_k, ctx_v, ctx_mask, attn_mask=None) → (out, k, v)`` (one
    causal layer call: the pre-norm outputs [R, n, d] and the new positions' K/V [R, H_kv, n, hd];
    ``attn_mask`` [R, n, P + n] replaces the causal mask, as the training forward needs),
    ``layer`` and ``norm``.
    """

    round = staticmethod(autoregressive_round)
    graph_specs = staticmethod(autoregressive_graph_specs)

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        return ("fuse", "context", "step")
    _returns_hidden = False

    def _num_cached_layers(self) -> int:  # the one causal layer whose K/V the loop caches
        return 1

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        raise NotImplementedError


class Eagle3FusedDrafter(_Eagle3Loop):
    """dspark's pre-reference Eagle3 (kind ``eagle3-fused``, format_version 1 checkpoints): one
    causal decoder layer whose input is W_in[emb(x_{t+1}) ; fuse(f_t)] (residual = that
    projection) over fused low/mid/high target features, γ autoregressive steps."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        s = config.layer
        d = s.hidden_size
        self.fuse = nn.Linear(3 * d, d, bias=False)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DraftLayer(s)
        self.norm = RMSNorm(d, s.rms_norm_eps)

    def _inputs(self, next_tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.in_proj(torch.cat([self.embed(next_tokens), feats], dim=-1))  # [..., d]

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fuse(features.to(self.fuse.weight.dtype))  # [n, d]

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        x = self._inputs(tokens, feats)  # [R, n, d]
        return self.layer(x, positions, ctx_k, ctx_v, ctx_mask, causal=True, return_kv=True, attn_mask=attn_mask)


def build_drafter(config: DrafterConfig) -> _NeuralDrafter:
    """The drafter module of ``config.kind`` (its registered :class:`~dspark.protocols.DrafterKind`)."""
    from dspark.drafters.kinds import drafter_kind

    return drafter_kind(config.kind).build(config)
