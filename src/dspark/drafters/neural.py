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

import time
from typing import Any

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.layers import DraftLayer, RMSNorm
from dspark.drafters.vocab import DraftVocab, to_slots, to_target_space
from dspark.protocols.drafter import DraftContext
from dspark.sampling import probs_for_requests, sample
from dspark.types import DraftBlock

__all__ = ["BlockDrafter", "Eagle3FusedDrafter", "build_drafter", "draft_lengths", "draft_sample", "target_features"]


class _ContextCache:
    """Per-request context K/V for every draft layer: lists of [H_kv, n, hd]."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=1)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=1)


def _pad_context(
    caches: list[_ContextCache], layer: int, shape: Any, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad per-request context K/V of one layer → K, V [R, H_kv, n_max, hd], mask [R, n_max]."""
    R = len(caches)
    n_max = max(c.length for c in caches)
    K = like.new_zeros(R, shape.num_kv_heads, n_max, shape.head_dim)
    Vv = like.new_zeros(R, shape.num_kv_heads, n_max, shape.head_dim)
    mask = torch.zeros(R, n_max, dtype=torch.bool, device=like.device)
    for r, c in enumerate(caches):
        if c.length:
            K[r, :, : c.length] = c.k[layer]
            Vv[r, :, : c.length] = c.v[layer]
            mask[r, : c.length] = True
    return K, Vv, mask


def target_features(
    context: DraftContext, drafter: str, layer_ids: tuple[int, ...], hidden_size: int
) -> list[torch.Tensor]:
    """The new target features of each request, checked: R × [n_new, m·d]."""
    feats = context.features.get("hidden")
    R = len(context.request_ids)
    if feats is None or len(feats) != R:
        raise ValueError(
            f"{drafter} drafter needs features['hidden']: one [n_new, m·d] tensor per request "
            f"(target hidden states at layers {list(layer_ids)})"
        )
    want = len(layer_ids) * hidden_size
    for rid, f in zip(context.request_ids, feats):
        if f.ndim != 2 or f.shape[1] != want:
            raise ValueError(
                f"request {rid!r}: features must be [n_new, {want}] (m={len(layer_ids)} "
                f"layers × hidden {hidden_size}), got {tuple(f.shape)}"
            )
    return feats


def draft_sample(logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] → (q [R, V], tokens [R]) under each request's sampling params.

    q is the distribution each token was drawn from (what verification needs). An all-greedy batch
    takes the argmax with a one-hot q, skipping the softmax and the V exponential draws per row.
    """
    if all(p.is_greedy for p in context.sampling):
        tokens = logits.float().argmax(-1)  # [R]
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, tokens[:, None], 1.0), tokens
    q = probs_for_requests(logits, context.sampling)  # [R, V]
    return q, sample(q, context.generators)


def draft_lengths(context: DraftContext, R: int, gamma: int) -> torch.Tensor:
    """Valid draft lengths [R]: γ, cut to the room the engine left each request."""
    valid = torch.full((R,), gamma, dtype=torch.long)
    if context.max_lengths is not None:
        valid = torch.minimum(valid, context.max_lengths.long().clamp_min(0))
    return valid  # [R]


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
        self._caches: dict[str, _ContextCache] = {}
        self.timings: dict[str, float] = {}  # seconds spent per part in the last draft() call
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
        self._lm_head = self._lm_head_full = lm_head_weight.detach()
        if self.config.draft_vocab_size is not None:
            self.vocab_map = DraftVocab(self.draft_ids, V)
            self._lm_head = self._lm_head_full[self.draft_ids]  # [V_d, d] (placeholder row masked by bias)
        head = getattr(self, "head", None)
        if callable(getattr(head, "bind_target", None)):
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
        U = h.to(self._lm_head.dtype) @ self._lm_head.T
        return U if self.vocab_map is None else U + self.vocab_map.bias.to(U.dtype)

    def _emit(self, U_j: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft-space Ũ_j [R, V_d] → (slots [R], target tokens [R], q [R, V], logits [R, V])."""
        q_d, x_d = self._sample_block(U_j, context)
        return (x_d, *to_target_space(self.vocab_map, x_d, q_d, U_j))

    # -- per-request state ----------------------------------------------------------------
    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    def _new_features(self, context: DraftContext) -> list[torch.Tensor]:
        return target_features(context, self.name, self.target_layer_ids, self.config.layer.hidden_size)

    def _check_anchor(self, rid: str, cache: _ContextCache, ids: torch.Tensor, lag: int) -> None:
        if cache.length != ids.numel() - lag:
            raise ValueError(
                f"request {rid!r}: the drafter has context for {cache.length} positions but the "
                f"anchor is at position {ids.numel() - 1}; pass the target features of every "
                "committed token before the anchor"
            )

    def _sample_block(self, logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_sample(logits, context)

    def _valid(self, context: DraftContext, R: int) -> torch.Tensor:
        return draft_lengths(context, R, self.gamma)


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
                if config.confidence and not callable(getattr(self.head, "prev_embedding", None)):
                    raise ValueError(
                        f"sequential head {config.head!r} has no prev_embedding(prev_tokens) -> [..., rank], "
                        "which the confidence head reads; build the drafter with confidence=False"
                    )
            if config.confidence:
                self.confidence_head = ConfidenceHead(s.hidden_size, config.rank)

    def mask_vector(self) -> torch.Tensor:
        """The embedding [d] of the block's mask slots: the target's (frozen) input embedding of
        ``mask_token_id`` as in the reference, or the learned vector of a pre-reference drafter."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        self._require_bound()
        return self._embed[self.config.mask_token_id].to(self.dtype)

    # -- separately callable parts (the export compiles them apart) -------------------------
    def ingest(self, cache: _ContextCache, features: torch.Tensor) -> None:
        """Fuse new context features [n_new, m·d] and append each layer's injected K/V."""
        n = features.shape[0]
        if n == 0:
            return
        ctx = self.fuse_norm(self.fuse(features.to(self.fuse.weight.dtype)))[None]  # [1, n, d]
        pos = torch.arange(cache.length, cache.length + n)[None]  # [1, n]
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, pos)  # [1, H_kv, n, hd]
            cache.append(i, k[0], v[0])
        cache.length += n

    def backbone(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, caches: list[_ContextCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """anchors [R], anchor_pos [R] → h [R, γ, d], base logits U [R, γ, V_d]."""
        R, g = anchors.shape[0], self.gamma
        skip = 0 if self.config.sample_from_anchor else 1  # z-lab DFlash: the anchor row predicts nothing
        x = torch.cat(
            [self.embed(anchors)[:, None], self.mask_vector().expand(R, g - 1 + skip, -1)], dim=1
        )  # [R, γ + skip, d]
        pos = anchor_pos[:, None] + torch.arange(g + skip)[None]  # [R, γ + skip]
        for i, layer in enumerate(self.layers):
            k, v, mask = _pad_context(caches, i, self.config.layer, x)
            x = layer(x, pos, k, v, mask)
        h = self.norm(x[:, skip:])  # [R, γ, d]
        return h, self.logits(h)

    @torch.inference_mode()
    def draft(self, context: DraftContext) -> DraftBlock:
        self._require_bound()
        feats = self._new_features(context)
        R = len(context.request_ids)
        caches = []
        for rid, ids, f in zip(context.request_ids, context.token_ids, feats):
            cache = self._caches.setdefault(rid, _ContextCache(len(self.layers)))
            self.ingest(cache, f)
            self._check_anchor(rid, cache, ids, lag=1)
            caches.append(cache)
        anchors = torch.stack([ids[-1] for ids in context.token_ids])  # [R]
        anchor_pos = torch.tensor([ids.numel() - 1 for ids in context.token_ids])  # [R]
        t0 = time.perf_counter()
        h, U = self.backbone(anchors, anchor_pos, caches)  # [R, γ, d], [R, γ, V]
        t_head = 0.0
        tokens, qs, logits, conf = [], [], [], []
        prev, state = self.to_draft(anchors), None  # x̂_0 = the anchor, as a draft slot
        for j in range(self.gamma):
            U_j = U[:, j].float()  # [R, V_d]
            if self.head is not None:
                t1 = time.perf_counter()
                U_j, state = self.head.step(prev, h[:, j], U_j, state)  # Ũ_j [R, V_d]
                if self.confidence_head is not None:
                    conf.append(self.confidence_head(h[:, j], self.head.prev_embedding(prev)))  # [R]
                t_head += time.perf_counter() - t1
            prev, x_j, q_j, U_full = self._emit(U_j, context)
            tokens.append(x_j)
            qs.append(q_j)
            logits.append(U_full)
        self.timings = {"draft": time.perf_counter() - t0, "sequential_head": t_head}
        return DraftBlock(
            tokens=torch.stack(tokens, 1),  # [R, γ]
            q=torch.stack(qs, 1),  # [R, γ, V]
            valid_lengths=self._valid(context, R),
            confidence_logits=torch.stack(conf, 1).float() if conf else None,  # [R, γ]
            draft_logits=torch.stack(logits, 1),
            hidden=h,
        )


class _Eagle3Loop(_NeuralDrafter):
    """The Eagle3 inference protocol shared by both layouts (:class:`Eagle3FusedDrafter`,
    :class:`dspark.drafters.eagle3.Eagle3Drafter`): per-request causal K/V cache, the pending
    feature of the last context position, γ autoregressive steps.

    A subclass provides ``_fuse(features [n, m·d]) → [n, d]``, ``_run(tokens [R, n], feats
    [R, n, d], positions [R, n], ctx_k, ctx_v, ctx_mask, attn_mask=None) → (out, k, v)`` (one
    causal layer call: the pre-norm outputs [R, n, d] and the new positions' K/V [R, H_kv, n, hd];
    ``attn_mask`` [R, n, P + n] replaces the causal mask, as the training forward needs) and
    ``norm``.
    """

    #: whether DraftBlock.hidden carries the per-step (pre-norm) layer outputs h_j
    _returns_hidden = False

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self._pending: dict[str, torch.Tensor] = {}  # fused feature of the last context position

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._pending.pop(request_id, None)

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        raise NotImplementedError

    @torch.inference_mode()
    def draft(self, context: DraftContext) -> DraftBlock:
        self._require_bound()
        feats = self._new_features(context)
        R, s = len(context.request_ids), self.config.layer
        caches, last_feat = [], []
        for rid, ids, f in zip(context.request_ids, context.token_ids, feats):
            cache = self._caches.setdefault(rid, _ContextCache(1))
            fused = self._fuse(f)  # [n_new, d]
            if self._pending.get(rid) is not None:
                fused = torch.cat([self._pending[rid], fused])
            if fused.shape[0] == 0:
                # A one-token prompt has no target feature yet: draft from a zero feature once,
                # and do not cache it (position −1 does not exist).
                last_feat.append(fused.new_zeros(s.hidden_size))
                self._pending[rid] = None
                caches.append(cache)
                continue
            # Positions t with both f_t and x_{t+1} committed go into the cache; the last feature
            # (t = a−1, paired with the anchor) is the first drafting step.
            n_ready = fused.shape[0] - 1
            if n_ready > 0:
                t0 = cache.length
                toks = ids[t0 + 1 : t0 + 1 + n_ready][None]  # [1, n]
                pos = torch.arange(t0, t0 + n_ready)[None]
                feat = fused[:n_ready][None]  # [1, n, d]
                k_ctx, v_ctx, mask = _pad_context([cache], 0, s, feat) if cache.length else (
                    feat.new_zeros(1, s.num_kv_heads, 0, s.head_dim), feat.new_zeros(1, s.num_kv_heads, 0, s.head_dim),
                    torch.zeros(1, 0, dtype=torch.bool))
                _, k, v = self._run(toks, feat, pos, k_ctx, v_ctx, mask)
                cache.append(0, k[0], v[0])
                cache.length += n_ready
            self._pending[rid] = fused[-1:]
            self._check_anchor(rid, cache, ids, lag=2)
            caches.append(cache)
            last_feat.append(fused[-1])
        k_ctx, v_ctx, mask = _pad_context(caches, 0, s, last_feat[0][None, None])
        feat = torch.stack(last_feat)  # [R, d]
        tok = torch.stack([ids[-1] for ids in context.token_ids])  # [R] x_{t+1} = anchor
        pos = torch.tensor([ids.numel() - 2 for ids in context.token_ids])  # [R] t = a − 1
        tokens, qs, logits, hidden = [], [], [], []
        for _ in range(self.gamma):
            out, k, v = self._run(tok[:, None], feat[:, None], pos[:, None], k_ctx, v_ctx, mask)  # out [R, 1, d]
            k_ctx, v_ctx = torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2)
            mask = torch.cat([mask, torch.ones(R, 1, dtype=torch.bool)], 1)
            h = self.norm(out[:, 0])  # [R, d]
            _, x_next, q, U = self._emit(self.logits(h).float(), context)  # [R], [R, V], [R, V]
            tokens.append(x_next)
            qs.append(q)
            logits.append(U)
            hidden.append(out[:, 0])
            tok, feat, pos = x_next, out[:, 0], pos + 1
        return DraftBlock(
            tokens=torch.stack(tokens, 1),
            q=torch.stack(qs, 1),
            valid_lengths=self._valid(context, R),
            draft_logits=torch.stack(logits, 1),
            hidden=torch.stack(hidden, 1) if self._returns_hidden else None,  # [R, γ, d]
        )


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
    """The drafter class of ``config.kind``: the reference Eagle3 (``eagle3``), dspark's
    pre-reference Eagle3 (``eagle3-fused``), else the block drafter (DSpark / DFlash)."""
    if config.kind == "eagle3":
        from dspark.drafters.eagle3 import Eagle3Drafter  # lazy: eagle3 imports this module

        return Eagle3Drafter(config)
    if config.kind == "eagle3-fused":
        return Eagle3FusedDrafter(config)
    return BlockDrafter(config)
