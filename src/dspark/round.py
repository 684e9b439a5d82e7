"""One speculative round, shared by the batched :class:`~dspark.engine.Engine` and the
single-request reference loop (:func:`~dspark.speculative.speculative_generate`).

    draft → confidence → calibrate → schedule → verify (the caller's target forward) → accept

Terms: R requests, γ block size, V vocabulary, ℓ_r verified draft tokens of request r. The caller
owns its target and caches: it passes ``verify_fn(tokens [R, 1+γ], lengths [R]) → (output,
logits [R, 1+γ, V])``, the one target forward over [anchor, x̂_1..x̂_γ] with ℓ_r valid drafts
per row, and does its own commit / rollback bookkeeping with the :class:`RoundResult`.
A round without a drafter (``draft=False``) is a plain decoding step through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from attrs import frozen

from dspark.protocols import DraftContext
from dspark.sampling import probs_for_requests, sample
from dspark.schedulers import build_schedule, with_sunk_seconds
from dspark.types import DraftBlock, SamplingParams
from dspark.verify import verify, verify_greedy

__all__ = ["RoundResult", "speculative_round", "accept"]

VerifyFn = Callable[[torch.Tensor, torch.Tensor], tuple[Any, torch.Tensor]]


@frozen
class RoundResult:
    """What one round decided and committed (tensors on the CPU)."""

    block: DraftBlock | None  # the drafts (None: a plain step)
    confidence_logits: torch.Tensor | None  # [R, γ] raw, before calibration
    lengths: torch.Tensor  # [R] ℓ_r verified draft tokens
    expected_tokens: float  # τ̂ the schedule expected (R for a plain step)
    accepted: torch.Tensor  # [R] accepted draft tokens
    committed: torch.Tensor  # [R, ≥ 1] committed tokens; row r's first accepted_r + 1 are real
    output: Any  # what verify_fn returned besides the logits (e.g. the target's hidden states)
    draft_seconds: float  # drafting + confidence + calibration + scheduling
    verify_seconds: float  # the target forward
    confidence: torch.Tensor | None = None  # [R, γ] calibrated (None: a plain step)

    @property
    def gamma(self) -> int:
        return 0 if self.block is None else self.block.gamma


def accept(
    block: DraftBlock | None,
    logits: torch.Tensor,  # [R, 1+γ, V] target logits at the anchor and each draft position
    lengths: torch.Tensor,  # [R] ℓ_r
    sampling: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification → (accepted [R], committed [R, 1+γ]): greedy token matching when every request
    is greedy, else lossless rejection sampling; without drafts, one token from the target.

    Acceptance runs on the CPU, where the requests' generators and the drafts live: a target on an
    accelerator hands over its argmax [R, 1+γ] (greedy) or its probabilities (sampling).
    """
    R = logits.shape[0]
    greedy = all(p.is_greedy for p in sampling)
    if block is None:
        first = logits[:, 0]  # [R, V]
        if greedy:
            nxt = first.float().argmax(-1).cpu()
        else:
            nxt = sample(probs_for_requests(first, sampling).cpu(), generators)
        return torch.zeros(R, dtype=torch.long), nxt[:, None]
    logits = logits[:, : block.gamma + 1]
    if greedy:
        res = verify_greedy(block.tokens, logits.float().argmax(-1).cpu(), lengths)
    else:
        res = verify(block.tokens, block.q, probs_for_requests(logits, sampling).cpu(), lengths, generators)
    return res.accepted, res.committed


def speculative_round(
    context: DraftContext,
    verify_fn: VerifyFn,
    *,
    drafter: Any = None,
    confidence_model: Any = None,
    calibrator: Any = None,
    scheduler: Any = None,
    cost_model: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RoundResult:
    """One round for the requests of ``context`` (their committed ids, sampling, generators and
    room for drafts). ``drafter=None`` runs a plain step: verify_fn gets the anchors alone."""
    R = len(context.request_ids)
    anchors = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R]
    block, raw, calibrated, expected = None, None, None, float(R)
    t0 = clock()
    if drafter is None:
        lengths = torch.zeros(R, dtype=torch.long)
        tokens = anchors[:, None]  # [R, 1]
    else:
        block = drafter.draft(context)
        raw = confidence_model.confidence_logits(block)  # [R, γ]
        calibrated = calibrator.calibrate(raw)  # [R, γ]
        seen_by_scheduler = with_sunk_seconds(scheduler, cost_model, clock() - t0)  # sps-greedy:sunk=true
        plan = build_schedule(scheduler, calibrated, block.valid_lengths, seen_by_scheduler)
        lengths, expected = plan.lengths, plan.expected_tokens  # [R]
        tokens = torch.cat([anchors[:, None], block.tokens], dim=1)  # [R, 1+γ]
    t_draft = clock() - t0
    t0 = clock()
    output, logits = verify_fn(tokens, lengths)
    t_verify = clock() - t0
    accepted, committed = accept(block, logits, lengths, context.sampling, context.generators)
    return RoundResult(block, raw, lengths, expected, accepted, committed, output, t_draft, t_verify, calibrated)
