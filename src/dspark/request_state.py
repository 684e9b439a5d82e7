"""The batched engine's per-request state (:class:`dspark.engine.Engine`) and what it hands back.

A request holds its committed tokens (prompt + output; the last one is the next round's anchor),
the target features its drafter has not seen yet, its sampling generator and its per-round
metrics; each round commits the accepted drafts and one target token to it
(:meth:`ActiveRequest.commit`). Terms: R requests, γ block size, ℓ verified drafts, m·d the width of
the captured target features (m layers of hidden size d).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from attrs import define, field, frozen

from dspark.protocols import TargetFeatures
from dspark.round import RoundResult
from dspark.types import SamplingParams

__all__ = ["ActiveRequest", "Completion", "RequestMetrics", "StepOutput", "catch_up_seconds"]


@define
class RequestMetrics:
    """Per-round records of one request."""

    rounds: int = 0
    proposed: list[int] = field(factory=list)  # valid draft length per round
    verified: list[int] = field(factory=list)  # ℓ per round
    accepted: list[int] = field(factory=list)  # accepted drafts per round
    confidence: list[list[float]] = field(factory=list)  # raw confidence logits [γ] per round

    @property
    def tau(self) -> float:
        """Mean committed tokens per round."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)

    def accepted_per_position(self, gamma: int) -> list[int]:
        """How many rounds accepted position j (1-based), j = 1..γ."""
        return [sum(a >= j for a in self.accepted) for j in range(1, gamma + 1)]

    def to_dict(self) -> dict[str, Any]:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "tau": self.tau, "mean_proposed": sum(self.proposed) / n,
                "mean_verified": sum(self.verified) / n, "accepted": sum(self.accepted)}


@frozen
class StepOutput:
    """The tokens one ``step()`` committed to a request, and why it finished (None: it runs on)."""

    request_id: str
    new_tokens: list[int]
    finished: str | None


@frozen
class Completion:
    """A finished request, as ``pop_finished`` / ``generate`` return it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, Any]
    rounds: RequestMetrics | None = None  # per-round proposed/verified/accepted/confidence


@define
class ActiveRequest:
    """One request in the engine, from ``add_request`` until it is collected."""

    rid: str
    tokens: torch.Tensor  # [n] committed ids (prompt + output)
    prompt_len: int
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    # Target features [n, m·d] of committed positions the drafter has not seen yet, in order (one
    # chunk per round; several after rounds the draft gate skipped, joined when drafting), the
    # first row at position feature_start. Rounds run without capture leave a gap: the features
    # are dropped and the next captured ones restart the drafter's context (DraftingLoop.cache_for).
    features: list[torch.Tensor] = field(factory=list)
    feature_start: int = 0
    finished: str | None = None  # "length" | "stop" | "abort"
    metrics: RequestMetrics = field(factory=RequestMetrics)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :].tolist()

    def room(self, max_context: int) -> int:
        """Room for drafts this round (may be negative: none): the round commits accepted + 1
        tokens, within max_new_tokens and the target's context (the anchor and ℓ drafts enter the cache)."""
        return min(self.max_new_tokens - (self.tokens.numel() - self.prompt_len) - 1,
                   max_context - self.tokens.numel() - 1)

    def pending_features(self, width: int) -> torch.Tensor:
        """The features waiting for the drafter, joined: [n_new, m·d] (``width`` = m·d; no rows
        when none were captured: the drafter's context restarts at the anchor)."""
        if not self.features:
            return torch.empty(0, width)
        return self.features[0] if len(self.features) == 1 else torch.cat(self.features)

    def pending_start(self) -> int:
        """The absolute position of the first pending feature row (the anchor's without any)."""
        return self.feature_start if self.features else self.tokens.numel() - 1

    def commit(self, result: RoundResult, row: int, features: torch.Tensor | None, anchor_position: int,
               max_context: int) -> list[int]:
        """Take row ``row`` of a round's ``result``: keep the captured ``features`` [R, 1 + γ, m·d]
        of the anchor and the accepted positions (None: a round without capture, a gap), record the
        metrics, append the committed tokens (cut at a stop token or the limits) and return them.
        ``anchor_position`` is where the anchor sits in the target's cache."""
        n_acc = int(result.accepted[row])
        new = result.committed[row, : n_acc + 1].tolist()
        if features is not None:
            if not self.features:
                self.feature_start = anchor_position
            self.features.append(features[row, : n_acc + 1])
        else:
            self.features = []  # a gap: the drafter restarts where capture resumes
        m = self.metrics
        m.rounds += 1
        m.verified.append(int(result.lengths[row]))
        m.accepted.append(n_acc)
        m.proposed.append(int(result.block.valid_lengths[row]) if result.block is not None and result.gamma else 0)
        if result.gamma and result.confidence_logits is not None:
            m.confidence.append(result.confidence_logits[row].tolist())
        new = self._truncate(new, max_context)
        self.tokens = torch.cat([self.tokens, torch.tensor(new, dtype=torch.long)])
        return new

    def _truncate(self, new: list[int], max_context: int) -> list[int]:
        """Cut at the first stop token (kept) and at max_new_tokens; mark the request finished."""
        for k, t in enumerate(new):
            if t in self.stop_ids:
                self.finished = "stop"
                return new[: k + 1]
        room = self.max_new_tokens - (self.tokens.numel() - self.prompt_len)
        if len(new) >= room:
            self.finished = "length"
            return new[:room]
        if self.tokens.numel() + len(new) >= max_context:
            self.finished = "length"
        return new


def catch_up_seconds(reqs: Sequence[ActiveRequest], features: TargetFeatures, timings: Mapping[str, float]) -> float:
    """The part of a drafted round's context ingestion that drafting every round would not have
    paid here: the feature rows captured in skipped rounds (``features``, what the round handed
    the drafter; ``reqs`` before their pending features are cleared). What drafting every round
    pays too is steady: each request's newest capture (the anchor and the tokens the last round
    accepted) and its prompt (a request joining pays it once whenever it drafts first; at high
    concurrency with turnover that is a real share of every round). The drafter's measured ingest
    time (``timings["ingest"]``) is split in proportion to the rows. The draft gate judges drafting
    on what drafting every round costs: the catch-up is the price of the skip before it, and
    charging it to the probe after the skip made that probe look like a loss (then the next skip
    was longer, and its probe's catch-up larger)."""
    ingest = float(timings.get("ingest", 0.0))
    rows = [int(h.shape[0]) for h in features.hidden]
    total = sum(rows)
    if ingest <= 0.0 or total == 0:
        return 0.0
    steady = 0
    for r, n in zip(reqs, rows):
        if not r.features:
            continue
        chunks = [int(c.shape[0]) for c in r.features]
        prompt = chunks[0] if r.feature_start == 0 else 0  # the prefill capture starts at position 0
        newest = chunks[-1] if len(chunks) > (1 if prompt else 0) else 0
        steady += min(prompt + newest, n)
    return ingest * (total - steady) / total
