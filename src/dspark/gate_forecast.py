"""The draft gate's measurements and its forecast: decayed rates and means, the speed factor, the
prior the gate may start from, and the acceptance survival and overheads the forecast reads.

The forecast (the rules the gate applies with it are in :mod:`dspark.gating`): acceptance does not
depend on the batch size R — a request's drafts are accepted or not whatever else is in the batch —
while the cost of a round does, and the cost model knows it. So :class:`AcceptanceForecast` keeps
the acceptance survival s_j = P(accepted ≥ j) over every drafted request-round, from the
calibrated confidences (their prefix products estimate it at every position, whether or not the
scheduler verified it; a confidence-chosen ℓ makes the verified positions a biased sample),
rescaled by accepted / expected-accepted drafts over the verified ones; and, per batch-size
bucket, the seconds a drafted round spends beyond its verification step (``overhead``: drafting,
the drafter catching up, bookkeeping) and a plain round's. With both, the best fixed draft length
at R says whether drafting can pay at a batch size before drafting there. A :class:`GatePrior`
(the survival measured on the workload, the overhead timed at some R) lets it decide from the
first round.

Seconds here are on the cost model's clock (:func:`speed_factor`): what is measured is the part of
a round the cost model does not describe, relative to the verification beside it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch
from attrs import define, field, frozen

from dspark.cost_models.accounting import (
    best_length,
    check_survival,
    fixed_length_rates,
    plain_step_seconds,
    round_seconds,
)
from dspark.protocols.cost_model import CostModel

__all__ = ["AcceptanceForecast", "DecayedMean", "DecayedRate", "GatePrior", "add_requests", "batch_bucket",
           "plain_step_seconds", "speed_factor"]


def batch_bucket(num_requests: int) -> int:
    """R → the power of two at or below it (1, 2, 4, ...): rates are compared within a bucket."""
    return 1 << (max(num_requests, 1).bit_length() - 1)


@define
class DecayedRate:
    """Exponentially decayed token and second sums, and the request-rounds seen."""

    tokens: float = 0.0
    seconds: float = 0.0
    evidence: int = 0

    def add(self, tokens: float, seconds: float, requests: int, decay: float) -> None:
        self.tokens = (1 - decay) * self.tokens + tokens
        self.seconds = (1 - decay) * self.seconds + seconds
        self.evidence += requests

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


@define
class DecayedMean:
    """An exponentially decayed mean of per-round values, and the request-rounds seen."""

    total: float = 0.0
    weight: float = 0.0
    evidence: int = 0

    def add(self, value: float, decay: float, requests: int) -> None:
        self.total = (1 - decay) * self.total + value
        self.weight = (1 - decay) * self.weight + 1.0
        self.evidence += requests

    @property
    def value(self) -> float:
        return self.total / max(self.weight, 1e-12)


def speed_factor(measured: float, modelled: float) -> float:
    """φ = a verification step's measured seconds / the cost model's t(B) + α(R) for it: how much
    slower than its profile the machine runs now (:mod:`dspark.gating`); 1 where either is not
    positive. Not clipped: whatever φ is, a round divided by it compares its drafting with the
    verification beside it and takes only the profile's shape t(B) / t(B′), so even a profile of
    another machine (φ = 10 under a test's tick clock) gives consistent units, where a clip would mix
    wall and profile seconds again. A stall in one verification inflates that round's φ; the
    gate's decayed sums hold it for a few rounds, as they held the stall's seconds before."""
    if not (measured > 0.0 and modelled > 0.0):
        return 1.0
    return measured / modelled


def add_requests(seen: set, current: Iterable[Hashable], num_requests: int, limit: int) -> None:
    """Add a round's request ids (``current``) to ``seen``, up to ``limit`` of them; a round
    observed without ids counts as ``num_requests`` new requests."""
    ids = current or {("anonymous", id(seen), len(seen) + i) for i in range(num_requests)}
    for rid in ids:
        if len(seen) >= limit:
            break
        seen.add(rid)


def _survival(value: Any) -> tuple[float, ...]:
    return tuple(check_survival(value))


def _overheads(value: Any) -> dict[int, float]:
    return {int(k): float(v) for k, v in dict(value).items()}


def _check_overheads(_: Any, __: Any, d: dict[int, float]) -> None:
    if not d or any(k < 1 or not math.isfinite(v) or v < 0 for k, v in d.items()):
        raise ValueError(f"draft_overhead must map batch sizes R >= 1 to seconds >= 0, got {d}")


@frozen
class GatePrior:
    """What the gate assumes before it has measured (module docstring): the drafter's acceptance
    survival s_j = P(accepted ≥ j), j = 1..γ, on this workload, and ``draft_overhead`` {R: seconds}
    a drafted round spends beyond a plain round at R requests, besides the verification of its
    drafts (drafting, the drafter catching up, bookkeeping), timed at some R — on the cost model's
    clock, as the gate measures its own (``DraftGate.speed_normalised``; ``dspark.bench.prior``)."""

    survival: tuple[float, ...] = field(converter=_survival)
    draft_overhead: Mapping[int, float] = field(converter=_overheads, validator=_check_overheads)

    def overhead_at(self, num_requests: int) -> float:
        """Piecewise linear in R between the timed points; flat below the first, and past the last
        along the last segment's slope (never below the last value: drafting costs more at larger R)."""
        pts = sorted(self.draft_overhead.items())
        R = float(num_requests)
        if R <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if R <= pts[0][0] else pts[0][1] * R / pts[0][0]
        for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
            if R <= r1:
                return v0 + (v1 - v0) * (R - r0) / (r1 - r0)
        (r0, v0), (r1, v1) = pts[-2], pts[-1]
        return max(v1 + (v1 - v0) * (R - r1) / (r1 - r0), v1)

    def to_dict(self) -> dict[str, Any]:
        return {"survival": list(self.survival), "draft_overhead": {str(k): v for k, v in self.draft_overhead.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GatePrior:
        try:
            return cls(d["survival"], d["draft_overhead"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"a gate prior needs 'survival' and 'draft_overhead': {e}") from None


@define
class AcceptanceForecast:
    """The survival and the overheads one draft gate measured, and the forecast from them (module
    docstring). The settings are the gate's: ``min_evidence`` drafted request-rounds from at least
    ``min_requests`` distinct requests replace the prior's survival (and, per bucket, its overhead);
    the survival sums decay by ``calibration_decay`` a request-round's worth, the overheads by
    ``decay`` a round."""

    min_evidence: int
    min_requests: int
    calibration_decay: float
    decay: float
    prior: GatePrior | None = None
    survival_sum: torch.Tensor | None = field(default=None, init=False)  # [γ] decayed Σ calibrated prefix survival
    survival_weight: float = field(default=0.0, init=False)  # decayed request-rounds in survival_sum
    accepted_drafts: DecayedRate = field(factory=DecayedRate, init=False)  # accepted ("tokens") vs expected ("seconds") drafts
    survival_evidence: int = field(default=0, init=False)  # drafted request-rounds seen
    survival_requests: set = field(factory=set, init=False)  # distinct drafted requests (up to min_requests)
    overhead: dict[int, DecayedMean] = field(factory=dict, init=False)  # bucket → drafted seconds beyond t(B) + α(R)
    plain_overhead: dict[int, DecayedMean] = field(factory=dict, init=False)  # bucket → plain seconds beyond t(R) + α(R)

    def survival(self) -> list[float] | None:
        """s_j, j = 1..γ: measured once ``min_evidence`` drafted request-rounds of at least
        ``min_requests`` distinct requests were seen (the mean calibrated prefix survival, times
        accepted / expected-accepted drafts where the scheduler verified any, clipped to 1); before
        that the prior's, or None. Distinct requests, because acceptance is correlated within one:
        at R = 1 the first rounds are the opening of one answer, which a drafter may miss entirely
        while it accepts often over the workload."""
        if (self.survival_evidence < self.min_evidence or self.survival_sum is None
                or len(self.survival_requests) < self.min_requests):
            return list(self.prior.survival) if self.prior is not None else None
        mean = self.survival_sum / max(self.survival_weight, 1e-12)  # [γ]
        a = self.accepted_drafts
        scale = a.tokens / a.seconds if a.evidence >= self.min_evidence and a.seconds > 0 else 1.0
        return (mean * scale).clamp(0.0, 1.0).cummin(dim=0).values.tolist()

    def draft_overhead(self, num_requests: int, cost_model: CostModel, gamma: int) -> float | None:
        """Seconds a drafted round spends beyond a plain one at R, besides verifying its drafts:
        measured in this bucket (once ``min_evidence`` request-rounds were: a request's first
        drafted round also ingests its whole prompt, so one round overstates it; and, where a prior
        exists, once plain rounds were measured here too: a drafted round's excess over t(B) + α(R)
        holds the engine's per-round work that a plain round pays as well, and only the plain
        rounds' excess cancels it), else the prior's, else the nearest measured bucket's scaled by
        the cost model's full-block step time at R over there (the drafter's forward is a block of
        R · (γ + 1) tokens too), else None."""
        b = batch_bucket(num_requests)

        def measured(k: int) -> float:
            plain = self.plain_overhead[k].value if k in self.plain_overhead else 0.0
            return max(self.overhead[k].value - plain, 0.0)

        if b in self.overhead and (self.prior is None or (self.overhead[b].evidence >= self.min_evidence
                                                          and b in self.plain_overhead)):
            return measured(b)
        if self.prior is not None:
            return self.prior.overhead_at(num_requests)
        if not self.overhead:
            return None
        near = min(self.overhead, key=lambda k: (abs(math.log2(k / b)), k))

        def full_block(r: int) -> float:
            return round_seconds(cost_model, cost_model.batch_size(torch.full((r,), gamma, dtype=torch.long)), r)

        return measured(near) * full_block(num_requests) / full_block(near)

    def forecast(self, num_requests: int, cost_model: CostModel) -> float | None:
        """The best fixed draft length's expected throughput at R over plain decoding's (1.0 when
        no length pays), from the survival and the overheads; None before there is either."""
        s = self.survival()
        extra = self.draft_overhead(num_requests, cost_model, len(s)) if s else None
        if not s or extra is None:
            return None
        b = batch_bucket(num_requests)
        base = max(self.plain_overhead[b].value, 0.0) if b in self.plain_overhead else 0.0
        rates = fixed_length_rates(s, cost_model, num_requests, extra, base)  # [γ + 1], k = 0 is plain
        return best_length(rates)[1] / rates[0]

    def observe_acceptance(self, survival: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor,
                           request_ids: Iterable[Hashable]) -> None:
        """survival [R, γ] calibrated prefix survival (cumprod of the calibrated confidences),
        lengths [R] verified drafts, accepted [R] accepted drafts of a drafted round of the
        requests ``request_ids`` (empty: unknown, each counts as new)."""
        survival = survival.detach().double().reshape(lengths.numel(), -1)  # [R, γ]
        add_requests(self.survival_requests, request_ids, lengths.numel(), self.min_requests)
        keep = 1.0 - self.calibration_decay
        total = survival.sum(dim=0)  # [γ]
        if self.survival_sum is None or self.survival_sum.numel() != total.numel():
            self.survival_sum, self.survival_weight = torch.zeros_like(total), 0.0
        self.survival_sum = keep * self.survival_sum + total
        self.survival_weight = keep * self.survival_weight + survival.shape[0]
        self.survival_evidence += survival.shape[0]
        lengths = lengths.long().flatten()  # [R]
        if int(lengths.sum()):
            upto = torch.arange(survival.shape[1]) < lengths[:, None]  # [R, γ] verified positions
            expected = float((survival * upto).sum())
            self.accepted_drafts.add(float(accepted.sum()), expected, int((lengths > 0).sum()), self.calibration_decay)

    def observe_overhead(self, num_requests: int, drafted: bool, excess: float) -> None:
        """A round's seconds beyond the cost model's t(B) + α(R) of its verification, in its bucket."""
        means = self.overhead if drafted else self.plain_overhead
        means.setdefault(batch_bucket(num_requests), DecayedMean()).add(excess, self.decay, num_requests)
