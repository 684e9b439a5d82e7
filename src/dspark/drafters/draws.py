"""What every drafting round does with the requests: checking their new target features, the
draws of the γ draft tokens under each request's sampling params, and the valid draft lengths.

Terms: R requests, γ block size, V vocabulary (V_d with a reduced draft vocabulary), m captured
target layers, d hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.drafters.vocab import NEG, DraftVocab
from dspark.protocols.drafter import DraftContext
from dspark.sampling import greedy_argmax, probs_for_requests, sample

__all__ = ["target_features", "feature_starts", "draft_sample", "draft_lengths", "Draws", "greedy_in_target_space"]


def target_features(
    context: DraftContext, drafter: str, layer_ids: tuple[int, ...], hidden_size: int
) -> list[torch.Tensor]:
    """The new target features of each request, checked: R × [n_new, m·d]."""
    feats = context.features.hidden if context.features is not None else None
    R = len(context.request_ids)
    if feats is None or len(feats) != R:
        raise ValueError(
            f"{drafter} drafter needs features=TargetFeatures(hidden=...): one [n_new, m·d] tensor "
            f"per request (target hidden states at layers {list(layer_ids)})"
        )
    want = len(layer_ids) * hidden_size
    for rid, f in zip(context.request_ids, feats):
        if f.ndim != 2 or f.shape[1] != want:
            raise ValueError(
                f"request {rid!r}: features must be [n_new, {want}] (m={len(layer_ids)} "
                f"layers × hidden {hidden_size}), got {tuple(f.shape)}"
            )
    return feats


def feature_starts(context: DraftContext) -> list[int | None]:
    """``features.start``: the absolute position of each request's first new feature row (None or
    absent: right after what the drafter holds). A start beyond the drafter's context restarts it
    there (:meth:`DraftingLoop.cache_for`)."""
    starts = context.features.start if context.features is not None else None
    if starts is None:
        return [None] * len(context.request_ids)
    if len(starts) != len(context.request_ids):
        raise ValueError(f"features.start holds {len(starts)} positions for "
                         f"{len(context.request_ids)} requests")
    return [None if s is None else int(s) for s in starts]


def draft_sample(logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] → (q [R, V], tokens [R]) under each request's sampling params.

    q is the distribution each token was drawn from (what verification needs). An all-greedy batch
    takes the argmax with a one-hot q, skipping the softmax and the V exponential draws per row.
    """
    if all(p.is_greedy for p in context.sampling):
        tokens = greedy_argmax(logits)  # [R]
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, tokens[:, None], 1.0), tokens
    q = probs_for_requests(logits, context.sampling)  # [R, V]
    return q, sample(q, context.generators)


def draft_lengths(context: DraftContext, R: int, gamma: int) -> torch.Tensor:
    """Valid draft lengths [R]: γ, cut to the room the engine left each request."""
    valid = torch.full((R,), gamma, dtype=torch.long)
    if context.max_lengths is not None:
        valid = torch.minimum(valid, context.max_lengths.long().clamp_min(0))
    return valid  # [R]


class Draws:
    """The γ draws of one round. An all-greedy batch takes each argmax where the logits are (the
    runner's device) and brings the round's logits to the CPU once, at the end; a sampled batch
    draws on the CPU step by step, with the requests' own generators."""

    def __init__(self, loop: Any, context: DraftContext) -> None:  # loop: a DraftingLoop
        self.loop, self.context = loop, context
        self.greedy = all(p.is_greedy for p in context.sampling)
        self.slots: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def draw(self, U_j: torch.Tensor) -> torch.Tensor:
        """Draft-space logits [R, V_d] → the drawn slots [R] (the next step's input)."""
        if self.greedy:
            slot = greedy_argmax(U_j)  # [R] on the runner's device
            self.slots.append(slot)
            self.logits.append(U_j)
            return slot
        slot, x, q, U = self.loop.sample(U_j, self.context)
        self.tokens.append(x)
        self.qs.append(q)
        self.logits.append(U)
        return slot

    def finish(self, gamma: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [R, n], q [R, n, V], logits [R, n, V]) in target space, on the CPU, for the n
        draws made; with ``gamma`` [R, γ], the positions past them undrawn (a refiner ended every
        draft early): token 0, a one-hot q on it and zero logits, beyond every valid length."""
        R, n = len(self.context.request_ids), len(self.logits)
        gamma = n if gamma is None else gamma
        if self.greedy:
            slots = torch.stack(self.slots, 1).cpu() if n else torch.zeros(R, 0, dtype=torch.long)  # [R, n]
            U = torch.stack(self.logits, 1).float().cpu() if n else None  # [R, n, V_d] one transfer a round
            return greedy_in_target_space(self.loop.spec.vocab_map, slots, U, gamma, self.loop.spec.vocab_size)
        if n:
            tokens, q, logits = torch.stack(self.tokens, 1), torch.stack(self.qs, 1), torch.stack(self.logits, 1)
        else:
            V = self.loop.spec.vocab_size
            tokens, q, logits = torch.zeros(R, 0, dtype=torch.long), torch.zeros(R, 0, V), torch.zeros(R, 0, V)
        if gamma == n:
            return tokens, q, logits
        q_end = q.new_zeros(R, gamma - n, q.shape[2])
        q_end[..., 0] = 1.0
        return (torch.cat([tokens, tokens.new_zeros(R, gamma - n)], 1), torch.cat([q, q_end], 1),
                torch.cat([logits, logits.new_zeros(R, gamma - n, logits.shape[2])], 1))


def greedy_in_target_space(
    vocab: DraftVocab | None, slots: torch.Tensor, U: torch.Tensor | None, gamma: int, V: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy draws in draft space — slots [R, n], logits U [R, n, V_d] — as the verifier needs
    them, padded to γ ≥ n: (target tokens [R, γ], one-hot q [R, γ, V], logits [R, γ, V]; ``NEG``
    where the draft vocabulary has no slot, as :func:`~dspark.drafters.vocab.to_target_space`
    maps a draw; past n token 0, q one-hot on it, logits 0).

    Written into tensors of the padded size at once: a round that ends its drafts early would
    otherwise build [R, n, V] q and logits, then copy them into [R, γ, V] ones (about half a
    millisecond a round at one request on a CPU, V = 49,152)."""
    R, n = slots.shape
    tokens = torch.zeros(R, gamma, dtype=torch.long)
    q, logits = torch.zeros(R, gamma, V), torch.zeros(R, gamma, V)
    q[:, n:, 0] = 1.0
    if n == 0:
        return tokens, q, logits
    if vocab is None:
        tokens[:, :n] = slots
        q[:, :n].scatter_(-1, slots[..., None], 1.0)
        logits[:, :n] = U
        return tokens, q, logits
    tokens[:, :n] = vocab.to_target(slots)
    drawn = (slots < vocab.size - 1).float()  # the placeholder slot has no target token (never drawn)
    q[:, :n].scatter_(-1, tokens[:, :n, None], drawn[..., None])
    vocab.full(U, NEG, out=logits[:, :n])
    return tokens, q, logits
