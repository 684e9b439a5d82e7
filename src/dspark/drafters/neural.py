"""What every neural drafter module shares: the bound target embedding / LM head, the reduced
draft vocabulary, and drafting through the one loop (:mod:`dspark.drafters.loop`) over the
drafter's own graphs. The kinds' modules subclass :class:`NeuralDrafter` in their folders:
:class:`dspark.drafters.dflash.model.BlockDrafter` (the parallel backbone),
:class:`dspark.drafters.dspark.model.DSparkDrafter` (+ sequential and confidence heads),
:class:`dspark.drafters.eagle3.model.Eagle3Drafter` (one autoregressive layer).

Terms: R requests, γ block size, V vocabulary, d hidden size, m captured target layers. For a
request whose anchor (last committed token) sits at absolute position a, the *context* is every
committed position before a; the engine hands the drafter the target's hidden states at
``target_layer_ids`` for context positions it has not seen yet (``DraftContext.features``, a
:class:`~dspark.protocols.TargetFeatures`: one [n_new, m·d] tensor per request), and the drafter caches per-layer context K/V only.

The target's token embedding and LM head are shared and frozen: they are bound from the target
(``bind_target``) and never saved with the drafter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.loop import DraftingLoop, KVStore, LoopSpec, TorchRunner
from dspark.drafters.vocab import DraftVocab, to_slots
from dspark.fast.linear import inference_linear, packs
from dspark.protocols.confidence import ConfidenceModel
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["NeuralDrafter", "build_drafter"]


class NeuralDrafter(nn.Module):
    """Shared plumbing: the bound target embedding / LM head, per-request caches, sampling."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.name = config.kind
        self.gamma = config.gamma
        self.vocab_size = config.vocab_size
        self.target_layer_ids = config.target_layer_ids
        # the confidence model a checkpoint folder ships (set by dspark.drafters.checkpoint), which
        # the engine uses by default; None: none of its own
        self.confidence_model: ConfidenceModel | None = None
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
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> NeuralDrafter:
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

    #: submodules whose weights a drafting round need not read (a kind whose steps may be served
    #: from a cache names them here), left out of :meth:`round_weight_bytes`
    round_may_skip: tuple[str, ...] = ()

    def round_weight_bytes(self) -> int:
        """Bytes of weights every drafting round reads at least once: the drafter's side of the
        memory-traffic floor (``dspark profile --drafter``). Each parameter of two or more
        dimensions (a product's weight: vectors are norms and biases) outside
        :attr:`round_may_skip`, each storage once, and the bound LM head's rows the drafter scores
        ([V_d, d]); not the token embedding, of which a round gathers a few rows."""
        skipped = set()
        for name in self.round_may_skip:
            if not hasattr(self, name):
                raise AttributeError(f"{type(self).__name__}.round_may_skip names {name!r}, which it does not have")
            module = getattr(self, name)  # None: this configuration has no such part (DSpark without a head)
            skipped |= {id(p) for p in module.parameters()} if module is not None else set()
        from dspark.profiling import distinct_bytes

        weights = [p for p in self.parameters() if p.ndim >= 2 and id(p) not in skipped]
        return distinct_bytes(weights + ([self._lm_head] if self._lm_head is not None else []))

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
    #: the round function (dspark.drafters.loop.RoundFn) and graph specs of this drafter's kind,
    #: set by each kind's module as ``staticmethod``s
    round: Any = None
    graph_specs: Any = None

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        """The graphs an export of this drafter holds (``config``: a DrafterConfig dict)."""
        raise NotImplementedError

    def loop_spec(self) -> LoopSpec:
        c = self.config
        return LoopSpec(
            kind=c.kind, gamma=c.gamma, vocab_size=c.vocab_size, hidden_size=c.layer.hidden_size,
            target_layer_ids=tuple(c.target_layer_ids), num_layers=self._num_cached_layers(),
            num_kv_heads=c.layer.num_kv_heads, head_dim=c.layer.head_dim, rank=c.rank,
            sample_from_anchor=c.sample_from_anchor, returns_hidden=self._returns_hidden,
            vocab_map=self.vocab_map, **self._head_fields())

    def _head_fields(self) -> dict[str, Any]:
        """LoopSpec's sequential-head fields (``head``, ``confidence``, ``stateful_head``): none here."""
        return {}

    #: whether DraftBlock.hidden carries h (block drafters) / the per-step outputs (Eagle3)
    _returns_hidden = True

    def _num_cached_layers(self) -> int:
        """How many draft layers' context K/V the loop caches."""
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


def build_drafter(config: DrafterConfig) -> NeuralDrafter:
    """The drafter module of ``config.kind`` (its registered :class:`~dspark.protocols.DrafterKind`)."""
    from dspark.drafters.kinds import drafter_kind

    return drafter_kind(config.kind).build(config)
