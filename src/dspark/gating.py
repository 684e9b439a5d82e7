"""The draft gate: stop drafting while drafting does not pay for itself.

The scheduler decides *after* the drafter ran, so even its ℓ = 0 schedule pays the drafting time.
At saturation (large R on a compute-bound target) plain decoding is fastest and the drafter's
forward is pure overhead; "never below plain decoding" needs the engine to skip it.

The gate compares measured rates, per batch-size bucket (R rounded down to a power of two):

    speculative rate  = Σ τ̂ / Σ seconds over drafted rounds  ×  ρ
    plain rate        = Σ R / Σ seconds over plain rounds
                        (before any plain round of this bucket ran: R / the cost model's plain
                        step, :func:`dspark.cost_models.plain_step_seconds` — the one-token step
                        run back to back where the profile records it, else t(B₀) + α(R))

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

The machine's speed drifts (a shared machine's step time can wander within a minute), and the
gate compares rounds measured at different moments: the plain rate of rounds run before a drafting
stretch against the drafted rounds of now, an overhead measured in a fast minute against one
measured in a slow one. A drift is then read as a gain or a loss of drafting, and near break-even
it decides (a wall-clock prior read against an older profile can forecast a loss where drafting
pays). So each round is put on the cost model's clock (``speed_normalised``, given the round's verification seconds): the speed factor
φ = measured verification seconds / the cost model's t(B) + α(R) of the same step (a plain
round's: the plain step, back to back; against the points, which are timed after another shape,
plain decoding's warm caches would read as the machine running fast and be normalised away), and every
second of the round — drafting, verification, the engine's own work — is divided by it. Rates and
overheads are then in the profile's seconds, whatever the machine's speed at the time: what the
gate still measures is the part of a round the cost model does not describe (drafting,
bookkeeping), relative to the verification beside it. What it now takes from the cost model is
the ratio of step times at different B (the profile's shape), not their level.

Lossless: a skipped round is plain decoding, and the decision reads only committed rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from attrs import define, field, frozen, validators

from dspark.cost_models.accounting import round_seconds
from dspark.gate_forecast import (
    AcceptanceForecast,
    DecayedRate,
    GatePrior,
    add_requests,
    batch_bucket,
    plain_step_seconds,
    speed_factor,
)
from dspark.protocols.cost_model import CostModel
from dspark.round import RoundResult

__all__ = ["DraftGate", "ObservedRound"]


@frozen
class ObservedRound:
    """What the gate reads of a finished round (:meth:`DraftGate.observe_round`): R, whether it
    drafted, the tokens it committed and its seconds; for a drafted round, where known, the drafting
    seconds and γ (which enable the bound), the scheduler's τ̂, and for the forecast the verified
    lengths ℓ [R], the accepted drafts [R] and the calibrated prefix survival [R, γ]. ``catch_up``:
    seconds of a drafted round spent ingesting the context of earlier skipped rounds (part of
    ``seconds`` and ``draft_seconds``); ``target_seconds``: the round's verification step, which
    puts the round on the cost model's clock (module docstring). The engine's rounds carry all of
    it (:meth:`from_result`); a simulator or a test may leave parts unknown (None)."""

    num_requests: int
    drafted: bool
    committed: int  # tokens committed over all requests
    seconds: float
    draft_seconds: float | None = None
    gamma: int = 0
    expected: float | None = None  # the scheduler's τ̂
    lengths: torch.Tensor | None = None  # [R] ℓ_r verified drafts
    accepted: torch.Tensor | None = None  # [R] accepted drafts
    survival: torch.Tensor | None = None  # [R, γ] calibrated prefix survival
    catch_up: float = 0.0
    target_seconds: float | None = None

    @classmethod
    def from_result(cls, result: RoundResult, seconds: float, catch_up: float = 0.0) -> ObservedRound:
        """The gate's view of an engine round: ``result`` and the ``seconds`` the whole round took."""
        drafted = result.drafted
        return cls(result.num_requests, drafted, result.committed_tokens, seconds,
                   draft_seconds=result.draft_seconds if drafted else None, gamma=result.gamma,
                   expected=float(result.expected_tokens) if drafted else None, lengths=result.lengths,
                   accepted=result.accepted, survival=result.survival, catch_up=catch_up,
                   target_seconds=result.verify_seconds)


@define
class DraftGate:
    """Stateful gate owned by one engine (module docstring). Drafting stops when plain is faster
    by more than ``margin`` (default 5 %). A margin of 1.0 also cuts near-ties, where the rates
    are noise and content alternates; 5 % leaves those alone and still stops a drafter that loses
    clearly (tests/test_gate_machines.py; docs/reports/2026-12-04-gate-and-start-up.md). The survival and overheads behind the forecast are
    ``forecaster``'s (:class:`dspark.gate_forecast.AcceptanceForecast`)."""

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
    speculative: dict[int, DecayedRate] = field(factory=dict, init=False)  # bucket → drafted rounds
    plain: dict[int, DecayedRate] = field(factory=dict, init=False)  # bucket → plain rounds
    calibration: DecayedRate = field(factory=DecayedRate, init=False)  # committed ("tokens") vs τ̂ ("seconds")
    wins: dict[int, int] = field(factory=dict, init=False)  # bucket → decisions that kept drafting
    reopened: int = field(default=0, init=False)  # skips ended because the batch turned over
    predicted_skips: int = field(default=0, init=False)  # skips decided by the forecast, without drafting
    forecaster: AcceptanceForecast = field(init=False)  # the survival and overheads the forecast reads
    rate_requests: dict[int, set] = field(factory=dict, init=False)  # bucket → distinct drafted requests (≤ min_requests)
    _probe_next: bool = field(default=False, init=False)  # the round after a forecast skip drafts
    _current: frozenset = field(factory=frozenset, init=False)  # the requests of this round
    # the last plain step read from the cost model, (model, R, seconds): a skipped round costs only
    # its forward and this lookup (the engine's bound model is one object per context bucket and R)
    _plain_read: tuple = field(default=(None, 0, 0.0), init=False)
    _skip_for: frozenset = field(factory=frozenset, init=False)  # the requests the skip was decided for

    @forecaster.default
    def _new_forecaster(self) -> AcceptanceForecast:
        return AcceptanceForecast(self.min_evidence, self.min_requests, self.calibration_decay, self.decay, self.prior)

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
                self.speculative[b] = DecayedRate(evidence=max(self.min_evidence - self.fresh_evidence, 0))
        if self.skip > 0:
            self.skip -= 1
            self.skipped_rounds += 1
            return False
        if self._probe_next:  # a forecast skip ran out: one real probe refreshes the evidence
            self._probe_next = False
            return True
        if (R and cost_model is not None
                and self.speculative.get(batch_bucket(R), DecayedRate()).evidence < self.min_evidence
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
    def forecast(self, num_requests: int, cost_model: CostModel) -> float | None:
        """The best fixed draft length's expected throughput at R over plain decoding's (1.0 when
        no length pays); None before there is a survival and an overhead (``forecaster``)."""
        return self.forecaster.forecast(num_requests, cost_model)

    def predicts_loss(self, num_requests: int, cost_model: CostModel) -> bool:
        """True when the forecast says no draft length beats plain decoding (by ``forecast_margin``)."""
        f = self.forecast(num_requests, cost_model)
        return f is not None and self._forecast_loses(f)

    def _forecast_loses(self, f: float) -> bool:
        """The forecast ``f`` (best fixed length over plain) says drafting does not pay."""
        return f <= 1.0 or f < self.forecast_margin

    # -- observing rounds ------------------------------------------------------------------
    def observe(self, result: RoundResult, seconds: float, cost_model: CostModel, catch_up: float = 0.0) -> bool:
        """Record an engine round: its ``result``, the ``seconds`` the whole round took and the
        ``catch_up`` seconds of its drafting spent on the context of skipped rounds (see
        :class:`ObservedRound`); returns True when the following rounds will skip drafting."""
        return self.observe_round(ObservedRound.from_result(result, seconds, catch_up), cost_model)

    def observe_round(self, r: ObservedRound, cost_model: CostModel) -> bool:
        """Record a finished round (:class:`ObservedRound`); returns True when the following rounds
        will skip drafting. The catch-up is left out of the rates, the overhead and the bound, which
        judge drafting every round — the catch-up is what the skip cost."""
        num_requests, drafted, committed, expected = r.num_requests, r.drafted, r.committed, r.expected
        lengths, accepted, gamma = r.lengths, r.accepted, r.gamma
        b = batch_bucket(num_requests)
        # the cost model's t(B) + α(R) of this round's verification: its speed factor, and the
        # overhead the round measures beyond it (None: a drafted round without its lengths)
        if not drafted:
            modelled = self._plain_step(cost_model, num_requests)
        elif lengths is not None:
            modelled = round_seconds(cost_model, cost_model.batch_size(lengths.long()), num_requests)
        else:
            modelled = None
        phi = 1.0 if not self.speed_normalised or r.target_seconds is None or modelled is None \
            else speed_factor(r.target_seconds, modelled)
        seconds, catch_up = r.seconds / phi, r.catch_up / phi
        draft_seconds = r.draft_seconds / phi if r.draft_seconds is not None else None
        paid = seconds  # what this probe cost, catch-up included (the probe budget's excess)
        if drafted and catch_up > 0.0:
            seconds = max(seconds - catch_up, 1e-9)
            if draft_seconds is not None:
                draft_seconds = max(draft_seconds - catch_up, 0.0)
        if not drafted:
            self.plain.setdefault(b, DecayedRate()).add(committed, seconds, num_requests, self.decay)
            self.forecaster.observe_overhead(num_requests, False, seconds - modelled)
            return False
        if lengths is not None and accepted is not None:
            if r.survival is not None:
                self.forecaster.observe_acceptance(r.survival, lengths, accepted, self._current)
            self.forecaster.observe_overhead(num_requests, True, seconds - modelled)
        spec = self.speculative.setdefault(b, DecayedRate())
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
        add_requests(self.rate_requests.setdefault(b, set()), self._current, num_requests, self.min_requests)
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
            seconds = plain_step_seconds(cost_model, num_requests)
            self._plain_read = (cost_model, num_requests, seconds)
        return seconds
