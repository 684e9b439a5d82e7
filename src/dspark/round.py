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

import attrs
import torch
from attrs import frozen

from dspark.drafters.draws import draft_lengths
from dspark.protocols import (
    Calibrator,
    ConfidenceModel,
    CostModel,
    DraftContext,
    Drafter,
    Scheduler,
)
from dspark.sampling import greedy_argmax, probs_for_requests, sample
from dspark.schedulers import build_schedule, with_sunk_seconds
from dspark.types import DraftBlock, SamplingParams
from dspark.verify import verify, verify_greedy

__all__ = ["RoundInfo", "RoundResult", "speculative_round", "accept", "schedule_stop"]

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

    @property
    def num_requests(self) -> int:
        """R, the requests of the round."""
        return self.lengths.numel()

    @property
    def drafted(self) -> bool:
        """False for a plain step (no drafter, or the draft gate skipped it)."""
        return self.block is not None

    @property
    def committed_tokens(self) -> int:
        """Tokens the round committed over all requests: R + Σ accepted."""
        return self.num_requests + int(self.accepted.sum())

    @property
    def survival(self) -> torch.Tensor | None:
        """[R, γ] calibrated prefix survival a_{r,j} = Π_{i≤j} c_{r,i} (None: a plain step)."""
        return None if self.confidence is None else torch.cumprod(self.confidence, dim=1)


@frozen
class RoundInfo:
    """What the engine's last ``step()`` did, for benchmarks and simulators (lists are per active
    request; seconds on the engine's clock)."""

    num_requests: int
    lengths: list[int]  # ℓ_r verified
    accepted: list[int]  # accepted drafts
    batch_size: int  # B under the cost model's accounting (padded count without a cost model)
    drafted: bool  # False: plain decoding (no drafter, or the draft gate skipped it)
    expected_tokens: float  # the scheduler's τ̂ (R on plain rounds)
    draft_seconds: float  # drafter + confidence + calibration + schedule
    target_seconds: float
    seconds: float
    context: float = 0.0  # mean KV context per request the round verified over (tokens)

    @classmethod
    def from_result(cls, result: RoundResult, batch_size: int, seconds: float, context: float) -> RoundInfo:
        """The record of ``result``, a round of ``batch_size`` verified tokens (B) that took
        ``seconds`` in all over a mean KV ``context`` per request."""
        return cls(result.num_requests, result.lengths.tolist(), result.accepted.tolist(), int(batch_size),
                   result.drafted, result.expected_tokens, result.draft_seconds, result.verify_seconds,
                   seconds, context)


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
            nxt = greedy_argmax(first).cpu()
        else:
            nxt = sample(probs_for_requests(first, sampling).cpu(), generators)
        return torch.zeros(R, dtype=torch.long), nxt[:, None]
    logits = logits[:, : block.gamma + 1]
    if greedy:
        # argmax only over the positions some request reads (1 + max ℓ); the columns after them
        # hold −1, beyond every request's accepted prefix and next token
        read = int(lengths.max()) + 1 if R else 1
        argmax = greedy_argmax(logits[:, :read]).cpu()  # [R, read]
        pad = argmax.new_full((R, block.gamma + 1 - read), -1)
        res = verify_greedy(block.tokens, torch.cat([argmax, pad], 1), lengths)
    else:
        res = verify(block.tokens, block.q, probs_for_requests(logits, sampling).cpu(), lengths, generators)
    return res.accepted, res.committed


def schedule_stop(
    context: DraftContext,
    gamma: int,
    confidence_model: ConfidenceModel | None,
    calibrator: Calibrator | None,
    scheduler: Scheduler | None,
    cost_model: CostModel | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The round's stopping rule for a drafter of block size ``gamma`` (``DraftContext.stop``), or
    None where it would not be exact.

    Why: a drafter with a sequential head and a confidence head steps γ times, but the schedule
    verifies ℓ ≤ γ drafts, and the steps past ℓ + 1 are wasted. A lossless scheduler decides on
    position j from c_1..j (and the valid length), never from c_{j+1..} (a stopping rule), so after
    step j it can be asked with the later confidences unknown (set to 0): where it verifies fewer
    than j, the whole block gets the same ℓ, and the drafter stops there, x̂_j undrawn. The rule is
    returned only where that holds exactly:

    * one request (at R > 1 a batch-global scheduler weighs position j against the other
      requests' later positions, which are not drawn yet);
    * a ``lossless`` and ``stateless`` scheduler (no clock, no earlier round: asking it again
      changes nothing);
    * confidence logits that are the head's own (``passes_head_logits``), calibrated position by
      position (``positionwise``).

    The rule: z [1, j] raw confidence logits of steps 1..j → [1] bool, True where position j
    will not be verified.
    """
    if len(context.request_ids) != 1 or scheduler is None or calibrator is None:
        return None
    if not (getattr(scheduler, "lossless", False) and getattr(scheduler, "stateless", False)
            and getattr(confidence_model, "passes_head_logits", False)
            and getattr(calibrator, "positionwise", False)):
        return None
    valid = int(draft_lengths(context, 1, gamma)[0])  # the block's valid length: γ cut to the room left
    rule = getattr(scheduler, "position_rule", None)
    verified = rule(valid, cost_model) if rule is not None else None

    def stop(z: torch.Tensor) -> torch.Tensor:
        j = z.shape[1]
        if j > valid:  # beyond the room left: never verified
            return torch.tensor([True])
        c = calibrator.calibrate(z)  # [1, j]
        if verified is not None:
            return torch.tensor([not verified(c)])
        unknown = c.new_zeros(1, gamma - j)  # c_{j+1..γ}: a stopping rule's decision on j never reads them
        return scheduler.lengths(torch.cat([c, unknown], 1), torch.tensor([valid]), cost_model) < j  # [1]

    return stop


def speculative_round(
    context: DraftContext,
    verify_fn: VerifyFn,
    *,
    drafter: Drafter | None = None,
    confidence_model: ConfidenceModel | None = None,
    calibrator: Calibrator | None = None,
    scheduler: Scheduler | None = None,
    cost_model: CostModel | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RoundResult:
    """One round for the requests of ``context`` (their committed ids, sampling, generators and
    room for drafts). ``drafter=None`` runs a plain step: verify_fn gets the anchors alone; a
    drafted round needs the confidence model, the calibrator and the scheduler."""
    R = len(context.request_ids)
    anchors = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R]
    block, raw, calibrated, expected = None, None, None, float(R)
    t0 = clock()
    if drafter is None:
        lengths = torch.zeros(R, dtype=torch.long)
        tokens = anchors[:, None]  # [R, 1]
    else:
        stop = schedule_stop(context, drafter.gamma, confidence_model, calibrator, scheduler, cost_model)
        block = drafter.draft(context if stop is None else attrs.evolve(context, stop=stop))
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
