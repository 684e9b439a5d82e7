"""Drafter: proposes a block of γ draft tokens per request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from attrs import field, frozen

from dspark.types import DraftBlock, SamplingParams


@frozen
class DraftContext:
    """What the engine hands a drafter for one round of R requests.

    ``token_ids`` are each request's committed tokens so far (prompt + output); the last one is the
    anchor. ``features`` carries target-side tensors a neural drafter needs (e.g. the target's
    hidden states at ``target_layer_ids`` for the newly committed positions), keyed by name.
    """

    request_ids: Sequence[str] = field()
    token_ids: Sequence[torch.Tensor] = field()  # R × [n_r] int64
    sampling: Sequence[SamplingParams] = field()
    generators: Sequence[torch.Generator] | None = field(default=None)
    max_lengths: torch.Tensor | None = field(default=None)  # [R] int64 room left per request
    features: Mapping[str, Any] = field(factory=dict)

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
    whose hidden states it reads from ``DraftContext.features["hidden"]`` (``()``: none, as the
    n-gram drafter); ``timings`` holds the seconds per part of its last ``draft`` call (at least
    ``{}``; ``"sequential_head"`` is reported by the engine).
    """

    name: str
    gamma: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    timings: Mapping[str, float]

    def draft(self, context: DraftContext) -> DraftBlock: ...

    def release(self, request_id: str) -> None: ...
