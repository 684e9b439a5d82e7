"""Prompt-lookup (n-gram) drafter: training-free, deterministic proposals.

For each request, find the most recent earlier occurrence of the context's trailing n-gram
(n from ``max_ngram`` down to ``min_ngram``) and propose the γ tokens that followed it. The draft
distribution is a point mass on the proposed token (q one-hot), so verification accepts x̂_j with
probability p_j(x̂_j) — lossless at any temperature. Confidence logits are a per-position prior
(``prior_acceptance``), fixed before any token is proposed, so every scheduler stays a stopping rule.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from attrs import field, frozen, validators

from dspark.drafters.config import MAX_GAMMA
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["NGramDrafter", "lookup_continuation"]


def lookup_continuation(tokens: list[int], gamma: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The ≤ γ tokens that followed the latest earlier match of the trailing n-gram, or []."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        tail = tokens[n_tok - n :]
        # scan right to left for the most recent earlier occurrence
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + gamma]
                if follow:
                    return follow
    return []


@frozen
class NGramDrafter:
    """Prompt-lookup drafting (as in HF ``prompt_lookup_num_tokens``) behind the Drafter protocol."""

    name = "ngram"
    target_layer_ids: ClassVar[tuple[int, ...]] = ()  # reads no target features
    timings: ClassVar[dict[str, float]] = {}  # nothing worth timing apart
    confidence_model: ClassVar[None] = None  # no confidence model of its own: the engine's default applies
    vocab_size: int = field(validator=[validators.instance_of(int), validators.gt(0)])
    gamma: int = field(default=7, validator=[validators.instance_of(int), validators.gt(0), validators.le(MAX_GAMMA)])
    min_ngram: int = field(default=1, validator=validators.gt(0))
    max_ngram: int = field(default=3, validator=validators.gt(0))
    prior_acceptance: float = field(default=0.5, validator=[validators.gt(0.0), validators.lt(1.0)])
    window: int = field(default=1024, validator=validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")

    def draft(self, context: DraftContext) -> DraftBlock:
        R, gamma, V = len(context.request_ids), self.gamma, self.vocab_size
        tokens = torch.zeros(R, gamma, dtype=torch.long)  # [R, γ]
        valid = torch.zeros(R, dtype=torch.long)  # [R]
        for r, ids in enumerate(context.token_ids):
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= V:
                bad = int(lo) if int(lo) < 0 else int(hi)
                raise ValueError(
                    f"request {context.request_ids[r]!r} has token id {bad} outside the "
                    f"drafter's vocabulary [0, {V})"
                )
            follow = lookup_continuation(ids[-self.window :].tolist(), gamma, self.min_ngram, self.max_ngram)
            if context.max_lengths is not None:
                follow = follow[: max(0, int(context.max_lengths[r]))]
            tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.long)
            valid[r] = len(follow)
        q = torch.zeros(R, gamma, V).scatter_(-1, tokens[..., None], 1.0)  # [R, γ, V] one-hot
        conf = torch.full((R, gamma), math.log(self.prior_acceptance / (1 - self.prior_acceptance)))
        return DraftBlock(tokens=tokens, q=q, valid_lengths=valid, confidence_logits=conf)

    def release(self, request_id: str) -> None:
        """Stateless: nothing to free."""
