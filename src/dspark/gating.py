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
the whole round — drafting, the drafter catching up on skipped tokens, verification, sampling —
and the calibrated τ̂ and the cost model describe only part of it. A bucket decides only once it has seen ``min_evidence`` drafted request-rounds (one
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

Lossless: a skipped round is plain decoding, and the decision reads only committed rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from attrs import define, field, validators

from dspark.cost_models import round_seconds
from dspark.protocols.cost_model import CostModel

__all__ = ["DraftGate", "batch_bucket"]


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


@define
class DraftGate:
    """Stateful gate owned by one engine (module docstring). Drafting stops when plain is faster
    by more than ``margin`` (default 5 %). Measured on the demo prompts (docs/engine.md): with 1.0
    the gate also cut near-ties, where the rates are noise and content alternates, and lost 7 %
    of DSpark's speed-up on an AVX-512-BF16 CPU; 1.05 kept all but 1 % of it, and still stops a
    drafter that loses by 9 % (tests/test_gate_machines.py)."""

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
    skip: int = field(default=0, init=False)  # rounds left to run without drafting
    backoff: int = field(default=0, init=False)  # the next skip length; 0 = min_backoff
    skipped_rounds: int = field(default=0, init=False)
    hopeless_rounds: int = field(default=0, init=False)  # drafted rounds the bound found hopeless
    speculative: dict[int, _Rate] = field(factory=dict, init=False)  # bucket → drafted rounds
    plain: dict[int, _Rate] = field(factory=dict, init=False)  # bucket → plain rounds
    calibration: _Rate = field(factory=_Rate, init=False)  # committed ("tokens") vs τ̂ ("seconds")
    wins: dict[int, int] = field(factory=dict, init=False)  # bucket → decisions that kept drafting
    reopened: int = field(default=0, init=False)  # skips ended because the batch turned over
    _current: frozenset = field(factory=frozenset, init=False)  # the requests of this round
    _skip_for: frozenset = field(factory=frozenset, init=False)  # the requests the skip was decided for

    def should_draft(self, request_ids: Sequence[str] | None = None) -> bool:
        """Call once per round (with the round's request ids, when known); False consumes one
        skipped round."""
        if request_ids is not None:
            self._current = frozenset(request_ids)
            b = batch_bucket(len(self._current))
            if (self.skip > 0 and self._skip_for and self._skip_for.isdisjoint(self._current)
                    and self.wins.get(b, 0) >= self.min_wins):
                self.skip, self.backoff = 0, 0
                self.reopened += 1
                # judge the new requests on fresh evidence: fresh_evidence more request-rounds
                self.speculative[b] = _Rate(evidence=max(self.min_evidence - self.fresh_evidence, 0))
        if self.skip > 0:
            self.skip -= 1
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

    def observe(self, num_requests: int, drafted: bool, committed: int, seconds: float,
                cost_model: CostModel, draft_seconds: float | None = None, gamma: int = 0,
                expected: float | None = None) -> bool:
        """Record a finished round (R, drafted?, tokens committed, its seconds; for drafted rounds
        optionally the drafting seconds and γ, which enable the bound, and the scheduler's τ̂);
        returns True when the following rounds will skip drafting."""
        b = batch_bucket(num_requests)
        if not drafted:
            self.plain.setdefault(b, _Rate()).add(committed, seconds, num_requests, self.decay)
            return False
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
        if spec.evidence < self.min_evidence:
            return False
        loss = plain / (self.margin * spec.rate * self._rho())
        if loss > 1.0:
            # The clearer the loss, the longer the first skip (a probe costs a drafted round plus
            # the drafter catching up): min_backoff · loss³, doubling on each further loss up to
            # max_backoff, or further while a probe costs more than probe_budget of the skip.
            tokens = (expected if expected is not None else committed) * self._rho()
            excess = max(seconds - tokens / plain, 0.0)
            cap = max(self.max_backoff, math.ceil(excess * plain / (num_requests * self.probe_budget)))
            self.skip = min(max(self.backoff, math.ceil(self.min_backoff * loss**3)), cap)
            self.backoff = min(2 * self.skip, cap)
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
        B0 = cost_model.batch_size(torch.zeros(num_requests, dtype=torch.long))
        return num_requests / round_seconds(cost_model, B0, num_requests)
