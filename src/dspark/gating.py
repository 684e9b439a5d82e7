"""The draft gate: stop drafting while drafting does not pay for itself.

The scheduler decides *after* the drafter ran, so even its ℓ = 0 schedule pays the drafting time.
At saturation (large R on a compute-bound target) plain decoding is fastest and the drafter's
forward is pure overhead; "never below plain decoding" needs the engine to skip it.

The gate compares measured rates, per batch-size bucket (R rounded down to a power of two):

    speculative rate  = Σ τ̂ / Σ seconds over drafted rounds  ×  ρ
    plain rate        = Σ R / Σ seconds over plain rounds
                        (before any plain round of this bucket ran: R / t(B₀) from the cost model)

both sums exponentially decayed (``decay`` per round of that kind), so the rates follow a changing
workload. τ̂ is the scheduler's expected committed tokens of the round (from the calibrated
confidences); ρ = Σ committed / Σ τ̂ over a long window (``calibration_decay``) corrects it for
miscalibration. Why not the committed tokens themselves: at R = 1 a round commits anywhere from 1 to
γ + 1 tokens, so a few rounds' committed count is mostly noise and one unlucky probe would keep the
drafter off for long; τ̂ is a low-noise estimate of the same expectation, and ρ keeps it honest.
(Rounds observed without τ̂ fall back to the committed tokens.) Measured, because what decides is
the whole round — drafting, verification, sampling, bookkeeping — and the calibrated τ̂ and the
cost model describe only part of it. Not the drafter catching up on the context of the rounds a
skip left out (the engine's ``catch_up`` seconds): that is the price of the skip, not of drafting
every round, and charged to the probe it made every probe after a skip look like a loss — the
next skip longer, its probe's catch-up larger (a machine in tests/test_gate_machines.py on which
drafting every round pays 1.5×: 15 drafted rounds of 590, 0.985× plain). A bucket decides only once it has seen ``min_evidence`` drafted request-rounds (one
round of R = 1 commits anywhere from 1 to γ + 1 tokens: too noisy to act on). Then, after each
drafted round, if plain is faster (by ``margin``) the next rounds skip the drafter:
``min_backoff`` · (plain / speculative)³ of them, doubling on each consecutive loss up to
``max_backoff``; a win resets it. Where a probe is expensive (a slow drafter, e.g. bf16 emulated
on an AVX2-only CPU, where the drafter catching up on the skipped tokens costs several plain steps)
the doubling may go past ``max_backoff``, up to the skip that keeps the probes' excess time under
``probe_budget`` (0.5 %) of plain decoding: excess / (probe_budget · plain round seconds), the
excess being the losing round's seconds beyond what plain decoding needs for its tokens.

Before any evidence, a bound: if even a round whose every draft is accepted (R · (γ + 1) tokens in
the measured draft seconds + t(B_full) from the cost model) would be slower than plain decoding,
drafting cannot pay at this batch size whatever the acceptance — a target whose verification cost
grows linearly with the tokens verified (bf16 emulated on an AVX2-only CPU). Then the gate skips
``hopeless_skip`` rounds at once, without spending ``min_evidence`` drafted rounds to find out, and
probes only that rarely (a probe re-measures the draft time, which may change).
Content changes what drafting is worth: at R = 1 a chat answer may lose while the next request, a
piece of code, wins by 1.5×. So when the batch has turned over completely since the skip was
decided (none of those requests is left: at R = 1, every new request), the skip ends and the new
requests are judged afresh on ``fresh_evidence`` drafted request-rounds — but only in a bucket
where drafting has won at least ``min_wins`` times: where it never wins (a machine on which
drafting does not pay), new requests do not reopen it and the probes stay rare.

The forecast. Acceptance does not depend on R (a request's drafts are accepted or not whatever
else is in the batch); the cost of a round does, and the cost model knows it. So the gate also keeps
the acceptance survival s_j = P(accepted ≥ j) over every drafted request-round — from the calibrated
confidences, whose prefix products estimate it at every position whether or not the scheduler
verified it (a confidence-chosen ℓ makes the verified positions a biased sample), rescaled by
accepted / expected-accepted drafts over the verified ones — and, per bucket, the seconds a
drafted round spends beyond its verification step (drafting, the drafter catching up, bookkeeping:
``overhead``) and a plain round's. With both, the best fixed draft length at R (``forecast``) says
whether drafting can pay at a batch size *before* drafting there: where no fixed length beats
plain decoding (by ``forecast_margin``), a bucket without measurements of its own skips
``forecast_probe`` rounds, then drafts one round to refresh the evidence; a measured loss confirmed
by the forecast skips ``hopeless_skip`` rounds; and a batch that turned over does not reopen drafting. A :class:`GatePrior` (the survival measured on the workload,
the overhead timed at some R) lets the forecast decide from the first round; without one it starts
once ``min_evidence`` drafted request-rounds have been seen, an overhead measured at another bucket
scaled by the cost model's full-block step time (the drafter's forward is a block of R · (γ + 1)
tokens too). The probes keep a wrong prior from holding
forever: ``min_evidence`` drafted request-rounds from at least ``min_requests`` distinct requests
replace its survival (one request's rounds are correlated: a drafter may miss the whole opening of
an answer), and as many request-rounds in a bucket, again from ``min_requests`` distinct requests
where the forecast says drafting pays, hand the decision there to the measured rates (its
overhead, once plain rounds were measured there too: a round's excess over the profile holds the
engine's own work, which drafted and plain rounds both pay). Distinct requests for the rates too:
at R = 1 one request whose opening the drafter missed can make the rates say "loss" and keep the
drafter off for the rest of a run in which drafting pays.

The machine's speed drifts (a shared VM's step time can wander by tens of percent within a
minute), and the gate compares rounds measured at different moments: the plain rate of rounds run
before a drafting stretch against the drafted rounds of now, an overhead measured in a fast minute
against one measured in a slow one. A drift is then read as a gain or a loss of drafting, and near
break-even it decides (a wall-clock prior read against an older profile can forecast a loss where
drafting pays; the measurements: docs/reports/2026-12-04-gate-and-start-up.md). So each round is put on the
cost model's clock (``speed_normalised``, given the round's verification seconds): the speed factor
φ = measured verification seconds / the cost model's t(B) + α(R) of the same step, and every
second of the round — drafting, verification, the engine's own work — is divided by it. Rates and
overheads are then in the profile's seconds, whatever the machine's speed at the time: what the
gate still measures is the part of a round the cost model does not describe (drafting,
bookkeeping), relative to the verification beside it. What it now takes from the cost model is
the ratio of step times at different B (the profile's shape), not their level.

Lossless: a skipped round is plain decoding, and the decision reads only committed rounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from attrs import define, field, frozen, validators

from dspark.cost_models.accounting import (
    best_length,
    check_survival,
    fixed_length_rates,
    round_seconds,
)
from dspark.protocols.cost_model import CostModel

__all__ = ["DraftGate", "GatePrior", "batch_bucket", "speed_factor"]


def batch_bucket(num_requests: int) -> int:
    """R → the power of two at or below it (1, 2, 4, ...): rates are compared within a bucket."""
    return 1 << (max(num_requests, 1).bit_length() - 1)


@define
class _Rate:
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


def speed_factor(measured: float, modelled: float) -> float:
    """φ = a verification step's measured seconds / the cost model's t(B) + α(R) for it: how much
    slower than its profile the machine runs now (module docstring); 1 where either is not
    positive. Not clipped: whatever φ is, a round divided by it compares its drafting with the
    verification beside it and takes only the profile's shape t(B) / t(B′), so even a profile of
    another machine (φ = 10 under a test's tick clock) gives consistent units, where a clip would mix
    wall and profile seconds again. A stall in one verification inflates that round's φ; the
    gate's decayed sums hold it for a few rounds, as they held the stall's seconds before."""
    if not (measured > 0.0 and modelled > 0.0):
        return 1.0
    return measured / modelled


def _survival(value: Any) -> tuple[float, ...]:
    return tuple(check_survival(value))


def _plain_step_seconds(cost_model: CostModel, num_requests: int) -> float:
    """t(B₀) + α(R): the cost model's plain decoding step of R requests."""
    return round_seconds(cost_model, cost_model.batch_size(torch.zeros(num_requests, dtype=torch.long)), num_requests)


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
class _Mean:
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


@define
class DraftGate:
    """Stateful gate owned by one engine (module docstring). Drafting stops when plain is faster
    by more than ``margin`` (default 5 %). A margin of 1.0 also cuts near-ties, where the rates
    are noise and content alternates; 5 % leaves those alone and still stops a drafter that loses
    by 9 % (tests/test_gate_machines.py; measured: docs/reports/2026-12-04-gate-and-start-up.md)."""

    min_backoff: int = field(default=2, validator=[validators.instance_of(int), validators.ge(1)])
    max_backoff: int = field(default=64, validator=[validators.instance_of(int), validators.ge(1)])
    margin: float = field(default=1.05, converter=float, validator=validators.gt(0.0))
    decay: float = field(default=0.2, converter=float, validator=[validators.ge(0.0), validators.lt(1.0)])
    min_evidence: int = field(default=8, validator=[validators.instance_of(int), validators.ge(1)])
    probe_budget: float = field(default=0.005, converter=float, validator=[validators.gt(0.0), validators.lt(1.0)])
    hopeless_skip: int = field(default=256, validator=[validators.instance_of(int), validators.ge(1)])
    calibration_decay: float = field(default=0.02, converter=float,
                                     validator=[validators.ge(0.0), validators.lt(1.0)])
    fresh_evidence: int = field(default=4, validator=[validators.instance_of(int), validators.ge(1)])
    min_wins: int = field(default=4, validator=[validators.instance_of(int), validators.ge(1)])
    prior: GatePrior | None = field(default=None, validator=validators.optional(validators.instance_of(GatePrior)))
    forecast_margin: float = field(default=1.0, converter=float, validator=validators.gt(0.0))
    forecast_probe: int = field(default=512, validator=[validators.instance_of(int), validators.ge(1)])
    min_requests: int = field(default=4, validator=[validators.instance_of(int), validators.ge(1)])
    speed_normalised: bool = field(default=True, validator=validators.instance_of(bool))
    skip: int = field(default=0, init=False)  # rounds left to run without drafting
    backoff: int = field(default=0, init=False)  # the next skip length; 0 = min_backoff
    skipped_rounds: int = field(default=0, init=False)
    hopeless_rounds: int = field(default=0, init=False)  # drafted rounds the bound found hopeless
    speculative: dict[int, _Rate] = field(factory=dict, init=False)  # bucket → drafted rounds
    plain: dict[int, _Rate] = field(factory=dict, init=False)  # bucket → plain rounds
    calibration: _Rate = field(factory=_Rate, init=False)  # committed ("tokens") vs τ̂ ("seconds")
    wins: dict[int, int] = field(factory=dict, init=False)  # bucket → decisions that kept drafting
    reopened: int = field(default=0, init=False)  # skips ended because the batch turned over
    predicted_skips: int = field(default=0, init=False)  # skips decided by the forecast, without drafting
    survival_sum: torch.Tensor | None = field(default=None, init=False)  # [γ] decayed Σ calibrated prefix survival
    survival_weight: float = field(default=0.0, init=False)  # decayed request-rounds in survival_sum
    accepted_drafts: _Rate = field(factory=_Rate, init=False)  # accepted ("tokens") vs expected ("seconds") drafts
    survival_evidence: int = field(default=0, init=False)  # drafted request-rounds seen
    survival_requests: set = field(factory=set, init=False)  # distinct drafted requests (up to min_requests)
    rate_requests: dict[int, set] = field(factory=dict, init=False)  # bucket → distinct drafted requests (≤ min_requests)
    overhead: dict[int, _Mean] = field(factory=dict, init=False)  # bucket → drafted seconds beyond t(B) + α(R)
    plain_overhead: dict[int, _Mean] = field(factory=dict, init=False)  # bucket → plain seconds beyond t(R) + α(R)
    _probe_next: bool = field(default=False, init=False)  # the round after a forecast skip drafts
    _current: frozenset = field(factory=frozenset, init=False)  # the requests of this round
    # the last plain step read from the cost model, (model, R, seconds): a skipped round costs only
    # its forward and this lookup (the engine's bound model is one object per context bucket and R)
    _plain_read: tuple = field(default=(None, 0, 0.0), init=False)
    _skip_for: frozenset = field(factory=frozenset, init=False)  # the requests the skip was decided for

    def should_draft(self, request_ids: Sequence[str] | None = None, cost_model: CostModel | None = None) -> bool:
        """Call once per round (with the round's request ids and its cost model, when known); False
        consumes one skipped round."""
        R = len(request_ids) if request_ids is not None else None
        if request_ids is not None:
            self._current = frozenset(request_ids)
            b = batch_bucket(len(self._current))
            if (self.skip > 0 and self._skip_for and self._skip_for.isdisjoint(self._current)
                    and self.wins.get(b, 0) >= self.min_wins
                    and not (cost_model is not None and self.predicts_loss(len(self._current), cost_model))):
                self.skip, self.backoff = 0, 0
                self.reopened += 1
                # judge the new requests on fresh evidence: fresh_evidence more request-rounds
                self.speculative[b] = _Rate(evidence=max(self.min_evidence - self.fresh_evidence, 0))
        if self.skip > 0:
            self.skip -= 1
            self.skipped_rounds += 1
            return False
        if self._probe_next:  # a forecast skip ran out: one real probe refreshes the evidence
            self._probe_next = False
            return True
        if (R and cost_model is not None
                and self.speculative.get(batch_bucket(R), _Rate()).evidence < self.min_evidence
                and self.predicts_loss(R, cost_model)):
            # no measurement of its own here, and the forecast says drafting cannot pay: skip without a probe
            self.predicted_skips += 1
            self.skip = self.forecast_probe - 1
            self._skip_for = self._current
            self._probe_next = True
            self.skipped_rounds += 1
            return False
        return True

    def features_needed(self, ahead: int) -> bool:
        """Should the engine capture target features this round? Yes while the next drafted round
        is at most ``ahead`` rounds away, and throughout skips in a batch-size bucket where drafting
        has won: such a skip may reopen at any new request, and its probe should draft with the
        whole context. A long skip where drafting has never won (a batch size at which this
        machine does not pay for drafting) captures nothing until shortly before its probe."""
        if self.skip < ahead:
            return True
        return bool(self._current) and self.wins.get(batch_bucket(len(self._current)), 0) > 0

    # -- the forecast ----------------------------------------------------------------------
    def survival(self) -> list[float] | None:
        """s_j, j = 1..γ: measured once ``min_evidence`` drafted request-rounds of at least
        ``min_requests`` distinct requests were seen (the mean calibrated prefix survival, times
        accepted / expected-accepted drafts where the scheduler verified any, clipped to 1); before
        that the prior's, or None. Distinct requests, because acceptance is correlated within one:
        at R = 1 the first eight rounds are the opening of one answer, which a drafter may miss
        entirely while its position-1 survival over the workload is 0.43 (bench14c, c = 1)."""
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
        holds the engine's per-round work that a plain round pays as well — 7 ms of a 31 ms plain
        round at R = 2 in bench29 — and only the plain rounds' excess cancels it), else the prior's,
        else the nearest measured bucket's scaled by the cost model's full-block step time at R over
        there (the drafter's forward is a block of R · (γ + 1) tokens too), else None."""
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

    def predicts_loss(self, num_requests: int, cost_model: CostModel) -> bool:
        """True when the forecast says no draft length beats plain decoding (by ``forecast_margin``)."""
        f = self.forecast(num_requests, cost_model)
        return f is not None and self._forecast_loses(f)

    def _forecast_loses(self, f: float) -> bool:
        """The forecast ``f`` (best fixed length over plain) says drafting does not pay."""
        return f <= 1.0 or f < self.forecast_margin

    def _observe_acceptance(self, survival: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        """survival [R, γ] calibrated prefix survival (cumprod of the calibrated confidences),
        lengths [R] verified drafts, accepted [R] accepted drafts."""
        survival = survival.detach().double().reshape(lengths.numel(), -1)  # [R, γ]
        self._add_requests(self.survival_requests, lengths.numel())
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

    def observe(self, num_requests: int, drafted: bool, committed: int, seconds: float,
                cost_model: CostModel, draft_seconds: float | None = None, gamma: int = 0,
                expected: float | None = None, lengths: torch.Tensor | None = None,
                accepted: torch.Tensor | None = None, survival: torch.Tensor | None = None,
                catch_up: float = 0.0, target_seconds: float | None = None) -> bool:
        """Record a finished round (R, drafted?, tokens committed, its seconds; for drafted rounds
        optionally the drafting seconds and γ, which enable the bound, the scheduler's τ̂, and for
        the forecast the per-request verified lengths ℓ [R], accepted drafts [R] and calibrated
        prefix survival [R, γ]); returns True when the following rounds will skip drafting.
        ``catch_up``: seconds of a drafted round spent ingesting the context of earlier skipped
        rounds (part of ``seconds`` and ``draft_seconds``); left out of the rates, the overhead and
        the bound, which judge drafting every round — the catch-up is what the skip cost.
        ``target_seconds``: the round's verification step, which puts the round on the cost model's
        clock (``speed_normalised``, module docstring)."""
        b = batch_bucket(num_requests)
        # the cost model's t(B) + α(R) of this round's verification: its speed factor, and the
        # overhead the round measures beyond it (None: a drafted round without its lengths)
        if not drafted:
            modelled = self._plain_step(cost_model, num_requests)
        elif lengths is not None:
            modelled = round_seconds(cost_model, cost_model.batch_size(lengths.long()), num_requests)
        else:
            modelled = None
        phi = 1.0 if not self.speed_normalised or target_seconds is None or modelled is None \
            else speed_factor(target_seconds, modelled)
        seconds, catch_up = seconds / phi, catch_up / phi
        if draft_seconds is not None:
            draft_seconds = draft_seconds / phi
        paid = seconds  # what this probe cost, catch-up included (the probe budget's excess)
        if drafted and catch_up > 0.0:
            seconds = max(seconds - catch_up, 1e-9)
            if draft_seconds is not None:
                draft_seconds = max(draft_seconds - catch_up, 0.0)
        if not drafted:
            self.plain.setdefault(b, _Rate()).add(committed, seconds, num_requests, self.decay)
            self.plain_overhead.setdefault(b, _Mean()).add(seconds - modelled, self.decay, num_requests)
            return False
        if lengths is not None and accepted is not None:
            if survival is not None:
                self._observe_acceptance(survival, lengths, accepted)
            self.overhead.setdefault(b, _Mean()).add(seconds - modelled, self.decay, num_requests)
        spec = self.speculative.setdefault(b, _Rate())
        if expected is None:
            spec.add(committed, seconds, num_requests, self.decay)
        else:
            spec.add(expected, seconds, num_requests, self.decay)
            self.calibration.add(committed, expected, num_requests, self.calibration_decay)
        plain = self._plain_rate(b, num_requests, cost_model)
        if draft_seconds is not None and gamma > 0:
            full = cost_model.batch_size(torch.full((num_requests,), gamma, dtype=torch.long))
            best = num_requests * (gamma + 1) / (draft_seconds + round_seconds(cost_model, int(full), num_requests))
            if best < plain:  # even with every draft accepted drafting is slower
                self.hopeless_rounds += 1
                self.skip = self.hopeless_skip
                self._skip_for = frozenset()  # machine-bound: new requests do not reopen it
                return True
        self._add_requests(self.rate_requests.setdefault(b, set()), num_requests)
        if spec.evidence < self.min_evidence:
            return False
        loss = plain / (self.margin * spec.rate * self._rho())
        if loss > 1.0:
            f = self.forecast(num_requests, cost_model)  # None before there is a forecast
            if len(self.rate_requests[b]) < self.min_requests and f is not None and not self._forecast_loses(f):
                # the forecast says drafting pays, and the measured loss comes from fewer than
                # min_requests requests (at R = 1: the opening of one answer): not enough to overturn it
                return False
            # The clearer the loss, the longer the first skip (a probe costs a drafted round plus
            # the drafter catching up): min_backoff · loss³, doubling on each further loss up to
            # max_backoff, or further while a probe costs more than probe_budget of the skip.
            tokens = (expected if expected is not None else committed) * self._rho()
            excess = max(paid - tokens / plain, 0.0)
            cap = max(self.max_backoff, math.ceil(excess * plain / (num_requests * self.probe_budget)))
            self.skip = min(max(self.backoff, math.ceil(self.min_backoff * loss**3)), cap)
            self.backoff = min(2 * self.skip, cap)
            if f is not None and self._forecast_loses(f):  # the forecast agrees: no short probes
                self.skip = max(self.skip, self.hopeless_skip)
            self._skip_for = self._current
            return True
        self.wins[b] = self.wins.get(b, 0) + 1
        self.backoff = 0
        return False

    def _add_requests(self, seen: set, num_requests: int) -> None:
        """Add this round's request ids (from should_draft) to ``seen``, up to ``min_requests`` of
        them; a round observed without ids counts as that many new requests."""
        ids = self._current or {("anonymous", id(seen), len(seen) + i) for i in range(num_requests)}
        for rid in ids:
            if len(seen) >= self.min_requests:
                break
            seen.add(rid)

    def _rho(self) -> float:
        """Committed / expected tokens over the long window (1 until there is evidence)."""
        c = self.calibration
        return c.tokens / c.seconds if c.evidence >= self.min_evidence and c.seconds > 0 else 1.0

    def _plain_rate(self, bucket: int, num_requests: int, cost_model: CostModel) -> float:
        """Measured plain tokens / s in this bucket; before any plain round: the cost model's R / t(B₀)."""
        if bucket in self.plain:
            return self.plain[bucket].rate
        return num_requests / self._plain_step(cost_model, num_requests)

    def _plain_step(self, cost_model: CostModel, num_requests: int) -> float:
        model, R, seconds = self._plain_read
        if model is not cost_model or R != num_requests:
            seconds = _plain_step_seconds(cost_model, num_requests)
            self._plain_read = (cost_model, num_requests, seconds)
        return seconds
