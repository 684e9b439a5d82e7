"""Drafter: proposes a block of γ draft tokens per request."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from attrs import field, frozen

from dspark.protocols.confidence import ConfidenceModel
from dspark.types import DraftBlock, SamplingParams


@frozen
class TargetFeatures:
    """The target's hidden states at a drafter's ``target_layer_ids`` for the committed positions
    the drafter has not seen yet, per request.

    ``hidden[r]`` holds one row per such position, in order: the states of the m target layers
    (width d each) concatenated. ``start[r]`` is the absolute position of request r's first row;
    None (for the batch or a request) means right after what the drafter already holds. A start
    beyond the drafter's context restarts it there: the engine leaves a gap where rounds ran
    without capture (:meth:`dspark.drafters.loop.DraftingLoop.cache_for`).
    """

    hidden: Sequence[torch.Tensor] = field()  # R × [n_new_r, m·d] float
    start: Sequence[int | None] | None = field(default=None)  # R absolute positions of row 0

    def __attrs_post_init__(self) -> None:
        if self.start is not None and len(self.start) != len(self.hidden):
            raise ValueError(f"TargetFeatures: {len(self.hidden)} requests' rows but {len(self.start)} start positions")


@frozen
class DraftContext:
    """What the engine hands a drafter for one round of R requests.

    ``token_ids`` are each request's committed tokens so far (prompt + output); the last one is the
    anchor. ``features`` carries the target's hidden states a neural drafter reads
    (:class:`TargetFeatures`; None for a drafter that reads none, as the n-gram drafter).
    """

    request_ids: Sequence[str] = field()
    token_ids: Sequence[torch.Tensor] = field()  # R × [n_r] int64
    sampling: Sequence[SamplingParams] = field()
    generators: Sequence[torch.Generator] | None = field(default=None)
    max_lengths: torch.Tensor | None = field(default=None)  # [R] int64 room left per request
    features: TargetFeatures | None = field(default=None)
    #: the round's stopping rule (:func:`dspark.round.schedule_stop`), or None: raw confidence logits
    #: of steps 1..j [R, j] → [R] bool, True where the round's schedule will verify no position ≥ j
    #: of that request. A drafter that steps its confidence head may then leave x̂_j undrawn and cut
    #: the request's valid length to j − 1; one that does not may ignore it.
    stop: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None)

    def __attrs_post_init__(self) -> None:
        n = len(self.request_ids)
        if len(self.token_ids) != n or len(self.sampling) != n:
            raise ValueError(
                f"DraftContext: {n} request ids but {len(self.token_ids)} token sequences and "
                f"{len(self.sampling)} sampling params"
            )
        if self.generators is not None and len(self.generators) != n:
            raise ValueError(f"DraftContext: {n} requests but {len(self.generators)} generators")
        for rid, ids in zip(self.request_ids, self.token_ids):
            if ids.ndim != 1:
                raise ValueError(
                    f"DraftContext: request {rid!r} token ids must be 1-D, got shape {tuple(ids.shape)}"
                )
            if ids.numel() == 0:
                raise ValueError(f"DraftContext: request {rid!r} has no anchor token (empty prompt)")


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to ``gamma`` tokens per request, sampled at each request's SamplingParams.

    A drafter may keep per-request state (a draft KV cache); ``release`` frees it when a request
    leaves. ``vocab_size`` must equal the target's. ``target_layer_ids`` names the target layers
    whose hidden states it reads from ``DraftContext.features`` (``()``: none, as the n-gram
    drafter); ``timings`` holds the seconds per part of its last ``draft`` call (at least ``{}``;
    the engine reports ``"sequential_head"`` and charges ``"ingest"``, the context catch-up, to the
    draft gate). ``confidence_model`` is the confidence model fitted for this drafter (a checkpoint
    folder's ``confidence.json``), which the engine uses unless told otherwise; None: none of its
    own (the engine's default, ``draft-head``, applies).
    """

    name: str
    gamma: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    timings: Mapping[str, float]
    confidence_model: ConfidenceModel | None

    def draft(self, context: DraftContext) -> DraftBlock: ...

    def release(self, request_id: str) -> None: ...
