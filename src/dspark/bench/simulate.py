"""Predicting serving throughput from recorded acceptance traces and a cost model.

A *trace* is one prompt's drafting rounds recorded with every valid position verified (the
``full`` scheduler, as ``dspark eval`` / ``dspark calibrate`` record them): per round the raw
confidence logits z [γ], the valid draft length and how many drafts the target accepted. Because
truncating verification is a stopping rule, a schedule that verifies ℓ of them accepts
min(accepted, ℓ) — exact for that round. The simulator treats a request's rounds as a stream it
replays in order (cycling when a shorter schedule needs more rounds than were recorded), and
runs the same loop as the engine: admission (closed loop or Poisson), calibrate → schedule with
the cost model read at the round's KV context (prompt + tokens generated so far, averaged over the
batch, as the engine reads it) → commit, the optional draft gate, and time advanced by a
:class:`TimeModel`.

What it does not model: how a shorter schedule changes *which* later rounds happen (replayed
rounds are treated as exchangeable), and target work beyond the cost model's step time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from attrs import define, field, frozen

from dspark.bench.records import LevelRun, RequestRecord, RoundRecord
from dspark.bench.runner import SchedulerSpec, arrival_times
from dspark.cost_models import round_seconds
from dspark.cost_models.context import ContextBinding
from dspark.gate_forecast import batch_bucket
from dspark.gating import ObservedRound
from dspark.schedulers import build_schedule, with_sunk_seconds

__all__ = ["Trace", "TimeModel", "traces_from_rounds", "fit_time_model", "simulate_level"]


@frozen
class Trace:
    """One prompt's recorded rounds: z [n, γ] raw confidence, proposed [n], accepted [n]."""

    confidence_logits: torch.Tensor  # [n, γ]
    proposed: torch.Tensor  # [n]
    accepted: torch.Tensor  # [n] under full verification
    tokens: int  # output tokens the request produced: Σ (accepted + 1), its length budget
    prompt_tokens: int = 64  # the prompt's length: where the request's KV context starts


def traces_from_rounds(rounds: Any, max_new_tokens: int | None = None,
                       prompt_tokens: Sequence[int] | None = None) -> list[Trace]:
    """Split a :class:`dspark.evaluation.rounds.Rounds` record into per-prompt traces (round order kept);
    ``prompt_tokens[p]`` is prompt p's length (the start of its KV context; default 64)."""
    by_prompt: dict[int, list[int]] = {}
    for i, p in enumerate(rounds.prompt):
        by_prompt.setdefault(p, []).append(i)
    traces = []
    for p in sorted(by_prompt):  # prompt order: request i replays prompt i, as the bench cycles them
        ix = torch.tensor(by_prompt[p])
        acc = rounds.accepted[ix]
        tokens = int((acc + 1).sum())
        if max_new_tokens is not None:
            tokens = min(tokens, max_new_tokens)
        length = 64 if prompt_tokens is None else int(prompt_tokens[p])
        traces.append(Trace(rounds.confidence_logits[ix], rounds.proposed[ix], acc, tokens, length))
    if not traces:
        raise ValueError("the rounds record holds no drafting rounds")
    return traces


def _affine(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares a + b·x (b clamped ≥ 0); a constant when x does not vary."""
    if not x:
        return 0.0, 0.0
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if np.ptp(xs) == 0:
        return float(ys.mean()), 0.0
    b, a = np.polyfit(xs, ys, 1)
    if b < 0:
        return float(ys.mean()), 0.0
    return float(a), float(b)


@frozen
class TimeModel:
    """Seconds per simulated round beyond the cost model's verification step:
    drafting (the median measured at each R, linear between measured R and along a + b·R beyond
    them; a + b·R alone where none was measured) plus ``draft_fraction`` × the cost model's step time of a
    full block (R · (1 + γ) tokens; for GPU presets, where nothing was measured: a one-layer drafter
    on a 30-layer target is roughly 1/30), engine overhead c + d·R (sampling, scheduling,
    bookkeeping; drafted and plain rounds apart), and a prefill per admitted request."""

    draft: tuple[float, float] = (0.0, 0.0)
    overhead_drafted: tuple[float, float] = (0.0, 0.0)
    overhead_plain: tuple[float, float] = (0.0, 0.0)
    prefill_seconds: float = 0.0
    draft_fraction: float = 0.0
    target_scale: float = 1.0  # measured verification time / the cost model's (context length, load)
    # the same ratio per shape bucket "R,B" (powers of two at or below R and B) where measured
    # rounds had that shape: the profile's t(B) + α(R) is off by different factors at different shapes
    shape_scales: dict[str, float] = field(factory=dict)
    # median drafting seconds at each R measured often enough: a CPU drafter's time is not affine
    # in R, and a line through the measured points would put the simulation too fast at some R and
    # too slow at others (kept in order of R, which draft_seconds reads in every simulated round)
    draft_by_requests: dict[int, float] = field(
        factory=dict, converter=lambda d: {int(k): float(v) for k, v in sorted(d.items(), key=lambda kv: int(kv[0]))})

    def draft_seconds(self, R: int, gamma: int = 0, cost_model: Any = None) -> float:
        seconds = self._measured_draft(R)
        if self.draft_fraction and cost_model is not None:
            full = cost_model.batch_size(torch.full((R,), gamma, dtype=torch.long))
            seconds += self.draft_fraction * float(cost_model.step_seconds(torch.tensor([full]))[0])
        return seconds

    def _measured_draft(self, R: int) -> float:
        a, b = self.draft
        if not self.draft_by_requests:
            return a + b * R
        rs, ys = list(self.draft_by_requests), list(self.draft_by_requests.values())  # ascending R
        if R < rs[0]:
            return max(ys[0] - b * (rs[0] - R), 0.0)
        if R > rs[-1]:
            return ys[-1] + b * (R - rs[-1])
        return float(np.interp(R, rs, ys))

    def scale(self, R: int, B: int) -> float:
        """Measured / modelled verification time for a round of R requests and B tokens."""
        return self.shape_scales.get(shape_key(R, B), self.target_scale)

    def overhead(self, R: int, drafted: bool) -> float:
        a, b = self.overhead_drafted if drafted else self.overhead_plain
        return a + b * R

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimeModel:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        return {"draft": list(self.draft), "overhead_drafted": list(self.overhead_drafted),
                "overhead_plain": list(self.overhead_plain), "prefill_seconds": self.prefill_seconds,
                "draft_fraction": self.draft_fraction, "target_scale": self.target_scale,
                "shape_scales": dict(self.shape_scales),
                "draft_by_requests": {str(k): v for k, v in self.draft_by_requests.items()}}


def fit_time_model(runs: Sequence[LevelRun], cost_model: Any = None, min_draft_rounds: int = 3) -> TimeModel:
    """Fit the drafting time (a line in R, and the median at each R with at least
    ``min_draft_rounds`` drafted rounds), the engine overhead (round − draft − target), the prefill
    time and (with ``cost_model``) the ratio of measured verification time to the model's from
    measured runs, so that a simulation on the same machine adds what the cost model lacks. Each
    round is modelled at the KV context it recorded (older records without one: at the model's own)."""
    rounds = [r for run in runs for r in run.rounds]
    drafted = [r for r in rounds if r.drafted]
    plain = [r for r in rounds if not r.drafted]
    prefill = [q.prefill_seconds for run in runs for q in run.requests]

    def overhead(rs: list[RoundRecord]) -> tuple[float, float]:
        return _affine([r.num_requests for r in rs],
                       [max(r.seconds - r.draft_seconds - r.target_seconds, 0.0) for r in rs])

    scale, shapes = 1.0, {}
    if cost_model is not None and rounds:
        at = ContextBinding(cost_model)
        sums: dict[str, list[float]] = {}
        for r in rounds:
            modelled = round_seconds(at(r.context, r.num_requests) if r.context else cost_model,
                                     r.batch_size, r.num_requests)
            acc = sums.setdefault(shape_key(r.num_requests, r.batch_size), [0.0, 0.0])
            acc[0] += r.target_seconds
            acc[1] += modelled
        scale = sum(a for a, _ in sums.values()) / sum(b for _, b in sums.values())
        shapes = {k: a / b for k, (a, b) in sums.items() if b > 0}
    by_requests: dict[int, list[float]] = {}
    for r in drafted:
        by_requests.setdefault(r.num_requests, []).append(r.draft_seconds)
    return TimeModel(_affine([r.num_requests for r in drafted], [r.draft_seconds for r in drafted]),
                     overhead(drafted), overhead(plain), float(np.median(prefill)) if prefill else 0.0,
                     target_scale=float(scale), shape_scales=shapes,
                     draft_by_requests={R: float(np.median(v)) for R, v in by_requests.items()
                                        if len(v) >= min_draft_rounds})


def shape_key(R: int, B: int) -> str:
    """The shape bucket of a round: R and B each rounded down to a power of two, as "R,B"."""
    return f"{batch_bucket(R)},{batch_bucket(B)}"


@define
class _SimRequest:
    record: RequestRecord
    trace: Trace
    cursor: int = 0
    budget: int = 0


def simulate_level(
    traces: Sequence[Trace],
    spec: SchedulerSpec,
    *,
    scheduler: Any,
    calibrator: Any,
    cost_model: Any,
    time_model: TimeModel,
    concurrency: int,
    num_requests: int,
    max_new_tokens: int,
    arrival: str = "closed",
    rate: float | None = None,
    draft_gate: Any = None,
    seed: int = 0,
) -> LevelRun:
    """One scheduler at one concurrency level, simulated (module docstring). ``scheduler`` is
    ignored for the ``plain`` spec; request i replays ``traces[i % len(traces)]``."""
    if not traces:
        raise ValueError("no traces to replay")
    arrivals = arrival_times(num_requests, arrival, rate, seed)
    pending = deque(range(num_requests))
    active: list[_SimRequest] = []
    done: list[RequestRecord] = []
    rounds: list[RoundRecord] = []
    clock = 0.0
    cost_model_at = ContextBinding(cost_model)
    while pending or active:
        while pending and len(active) < concurrency and arrivals[pending[0]] <= clock:
            i = pending.popleft()
            trace = traces[i % len(traces)]
            rec = RequestRecord(f"{spec.label}-{i}", arrivals[i], admitted=clock,
                                prefill_seconds=time_model.prefill_seconds)
            clock += time_model.prefill_seconds
            active.append(_SimRequest(rec, trace, 0, min(trace.tokens, max_new_tokens)))
        if not active:
            clock = max(clock, arrivals[pending[0]])
            continue
        R = len(active)
        context = sum(q.trace.prompt_tokens + q.record.new_tokens for q in active) / R
        cm = cost_model_at(context, R)  # the round's KV context, as the engine reads it
        drafted = not spec.plain and (draft_gate is None or draft_gate.should_draft([q.record.request_id for q in active], cm))
        draft_s = 0.0
        if drafted:
            gamma = active[0].trace.confidence_logits.shape[1]
            rows = [q.trace.confidence_logits.shape[0] for q in active]
            z = torch.stack([q.trace.confidence_logits[q.cursor % n] for q, n in zip(active, rows)])  # [R, γ]
            full_acc = torch.tensor([int(q.trace.accepted[q.cursor % n]) for q, n in zip(active, rows)])  # [R]
            room = torch.tensor([q.budget - q.record.new_tokens - 1 for q in active]).clamp_min(0)  # [R]
            proposed = torch.tensor([int(q.trace.proposed[q.cursor % n]) for q, n in zip(active, rows)])
            valid = torch.minimum(torch.minimum(proposed, room), torch.tensor(gamma))  # [R]
            calibrated = calibrator.calibrate(z)  # [R, γ]
            draft_s = time_model.draft_seconds(R, gamma, cm)
            plan = build_schedule(scheduler, calibrated, valid, with_sunk_seconds(scheduler, cm, draft_s))
            lengths = plan.lengths  # [R]
            accepted = torch.minimum(full_acc, lengths)  # [R]
            for q in active:
                q.cursor += 1
        else:
            lengths = torch.zeros(R, dtype=torch.long)
            accepted = torch.zeros(R, dtype=torch.long)
        B = cm.batch_size(lengths)
        target_s = time_model.scale(R, int(B)) * round_seconds(cm, int(B), R)
        seconds = draft_s + target_s + time_model.overhead(R, drafted)
        rounds.append(RoundRecord(clock, seconds, R, int(lengths.sum()), int(lengths.max()), int(B),
                                  int(accepted.sum()), drafted, draft_s, target_s, context))
        clock += seconds
        if draft_gate is not None:
            draft_gate.observe_round(ObservedRound(
                R, drafted, R + int(accepted.sum()), seconds,
                draft_seconds=draft_s if drafted else None, gamma=gamma if drafted else 0,
                expected=float(plan.expected_tokens) if drafted else None,
                lengths=lengths if drafted else None, accepted=accepted if drafted else None,
                survival=torch.cumprod(calibrated, dim=1) if drafted else None), cm)
        still = []
        for q, acc in zip(active, accepted.tolist()):
            rec = q.record
            rec.rounds += 1
            rec.new_tokens = min(rec.new_tokens + acc + 1, q.budget)
            if math.isnan(rec.first_token):
                rec.first_token = clock
            if rec.new_tokens >= q.budget:
                rec.finished = clock
                done.append(rec)
            else:
                still.append(q)
        active = still
    done.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    return LevelRun(spec.label, concurrency, arrival, rate, max(r.finished for r in done), rounds, done,
                    simulated=True)
