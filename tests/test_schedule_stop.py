"""The round's stopping rule (dspark.round.schedule_stop): the sequential head stops stepping where
the round's schedule ends the draft.

* the oracle is the scheduler itself on the whole block: after every step j, the rule says "stop"
  exactly where the whole block's ℓ < j (random confidences, every built-in lossless scheduler,
  the positionwise calibrators);
* no rule where it would not be exact: several requests, a scheduler that keeps state or reads the
  clock, a lossy one, a confidence model or calibrator that does not declare what the rule needs;
* the drafter: a block drafted with the rule has the whole block's ℓ as its valid length, equals
  the block without the rule up to there, and steps its head fewer times; the engine at one
  request stays greedy-identical to the target's own decode and keeps the sampled law (χ²).
"""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

import dspark
from dspark.calibration import IdentityCalibrator, STSCalibrator, TemperatureCalibrator
from dspark.confidence import DraftHeadConfidence, MaxProbConfidence
from dspark.drafters.loop import GraphCalls
from dspark.engine import Engine
from dspark.fast import FastTarget
from dspark.protocols.drafter import DraftContext
from dspark.round import schedule_stop
from dspark.types import SamplingParams
from helpers import (
    TickClock,
    assert_same_distribution,
    exact_two_token_probs,
    greedy_decode,
    sequence_counts,
)
from test_fast_drafter import _contexts, _model, _ort_drafter
from test_fast_step import PROMPTS, V

pytestmark = pytest.mark.usefixtures("one_thread")

G = 6  # γ of the rule's oracle test
#: a step that costs more with every verified token, t(B) = 1 + 0.3 (B − 1) s: sps-greedy stops
SLOPED = dspark.get_cost_model("sps-table", profile={
    "device": "test", "model": "tiny", "dtype": "float32", "date": "2026-12-06", "accounting": "packed",
    "points": [{"batch_size": 1, "step_seconds": 1.0}, {"batch_size": 33, "step_seconds": 10.6}]})

class _HalfScheduler:
    """A plugin's lossless, stateless scheduler without ``position_rule`` whose answer reads the
    valid length: verify the first half of every draft (docs/plugins.md)."""

    name = "half"
    lossless = True
    stateless = True

    def lengths(self, c, valid, cost_model=None):
        return valid // 2


class _UntilLowScheduler(_HalfScheduler):
    """Another, reading the confidences: verify while c_j ≥ 0.4."""

    def lengths(self, c, valid, cost_model=None):
        keep = (c >= 0.4) & (torch.arange(c.shape[1])[None, :] < valid[:, None])
        return torch.cumprod(keep.long(), 1).sum(1)


SCHEDULERS = [("full", {}), ("fixed", {"k": 2}), ("threshold", {"threshold": 0.6}),
              ("threshold", {"threshold": 0.3, "mode": "survival"}), ("sps-greedy", {}),
              ("plugin: half", _HalfScheduler()), ("plugin: until low", _UntilLowScheduler())]
CALIBRATORS = [IdentityCalibrator(), TemperatureCalibrator(temperature=0.7),
               STSCalibrator(temperatures=(0.8, 1.3, 0.5, 2.0, 1.1, 0.9))]


def _context(room: int | None = None) -> DraftContext:
    """One request's round with ``room`` for drafts (None: γ)."""
    return DraftContext(["r0"], [torch.tensor([3, 5])], [SamplingParams.greedy()],
                        max_lengths=None if room is None else torch.tensor([room]))


@pytest.mark.parametrize("room", [None, 3])
@pytest.mark.parametrize("sched,kwargs", SCHEDULERS, ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=lambda c: c.name)
def test_the_rule_stops_exactly_where_the_whole_blocks_schedule_ends(sched, kwargs, calibrator, room):
    scheduler = kwargs if not isinstance(kwargs, dict) else dspark.get_scheduler(sched, **kwargs)
    valid = G if room is None else min(G, room)
    stop = schedule_stop(_context(room), G, DraftHeadConfidence(), calibrator, scheduler, SLOPED)
    assert stop is not None
    gen = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(200):
        z = torch.randn(1, G, generator=gen) * 2 + 1  # raw confidence logits of a whole block
        ell = int(scheduler.lengths(calibrator.calibrate(z), torch.tensor([valid]), SLOPED)[0])
        for j in range(1, G + 1):  # after step j the drafter holds z_1..z_j only
            assert bool(stop(z[:, :j])[0]) == (ell < j), f"{sched}: step {j}, whole block ℓ = {ell}"
        lengths.append(ell)
    if sched in ("full", "plugin: half"):
        assert set(lengths) == {valid if sched == "full" else valid // 2}
    else:
        assert min(lengths) < valid and max(lengths) > 0  # the rule stopped some drafts, not all at once


#: padded, with a per-request overhead α(1) and a step that rises in steps: Θ's other branch
STEPPED = dspark.get_cost_model("sps-table", profile={
    "device": "test", "model": "tiny", "dtype": "float32", "date": "2026-12-07", "accounting": "padded",
    "points": [{"batch_size": 1, "step_seconds": 1.0}, {"batch_size": 3, "step_seconds": 1.1},
               {"batch_size": 4, "step_seconds": 1.6}, {"batch_size": 8, "step_seconds": 1.9}],
    "batch_overhead": [{"num_requests": 1, "seconds": 0.4}]})


@pytest.mark.parametrize("cost_model", [SLOPED, STEPPED], ids=["packed", "padded+overhead"])
def test_sps_greedy_rule_carried_from_step_to_step_decides_as_the_whole_block(cost_model):
    """sps-greedy's ``position_rule`` carries τ and Θ between the steps of a round; the oracle is
    :func:`sps_greedy_lengths` on each whole block: confidences with ties (c = 1, repeated values)
    and zeros, valid lengths below γ, and calls that do not continue the last prefix (a new block
    at any step, the same step asked twice) — each must answer as a fresh rule would."""
    from dspark.schedulers import sps_greedy_lengths

    scheduler = dspark.get_scheduler("sps-greedy")
    gen = torch.Generator().manual_seed(7)
    rules = {valid: scheduler.position_rule(valid, cost_model) for valid in range(1, G + 1)}
    decided = set()
    for n in range(600):
        valid = 1 + n % G
        c = torch.rand(1, G, generator=gen)
        if n % 3 == 0:
            c = (c * 4).round() / 4  # repeated values, exact 0 and 1
        ell = int(sps_greedy_lengths(c, torch.tensor([valid]), cost_model)[0][0])
        decided.add(ell)
        rule = rules[valid]
        first = 1 + n % 4 if n % 5 == 0 else 1  # sometimes a block first seen at step > 1
        for j in range(first, valid + 1):
            assert rule(c[:, :j]) == (j <= ell), f"block {n}, step {j}: whole block ℓ = {ell}"
            if j == 2 and n % 7 == 0:
                assert rule(c[:, :j]) == (j <= ell)  # the same step again
        if valid < G:
            assert not rule(c[:, : valid + 1])  # past the valid length: never verified
    assert len(decided) >= 3  # the cost models stop drafts at several lengths


class _WholeBlockCalibrator:
    """A calibrator that does not declare ``positionwise``."""

    name = "whole-block"

    def calibrate(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(z - z.mean(1, keepdim=True))


class _UndeclaredScheduler:
    """A lossless scheduler that does not declare ``stateless``."""

    name = "undeclared"
    lossless = True

    def lengths(self, c, valid, cost_model=None):
        return valid


def test_no_rule_where_it_would_not_be_exact():
    head, identity, sps = DraftHeadConfidence(), IdentityCalibrator(), dspark.get_scheduler("sps-greedy")
    one, two = _context(), DraftContext(["a", "b"], [torch.tensor([3]), torch.tensor([5])],
                                        [SamplingParams.greedy()] * 2)
    assert schedule_stop(one, G, head, identity, sps, SLOPED) is not None
    assert schedule_stop(two, G, head, identity, sps, SLOPED) is None  # batch-global: the others weigh in
    assert schedule_stop(one, G, head, identity, dspark.get_scheduler("sps-greedy", lag=1), SLOPED) is None
    assert schedule_stop(one, G, head, identity, dspark.get_scheduler("sps-greedy", sunk=True), SLOPED) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossy = dspark.get_scheduler("sps-argmax")
    assert schedule_stop(one, G, head, identity, lossy, SLOPED) is None
    assert schedule_stop(one, G, head, identity, _UndeclaredScheduler(), SLOPED) is None
    assert schedule_stop(one, G, MaxProbConfidence(), identity, sps, SLOPED) is None
    assert schedule_stop(one, G, head, _WholeBlockCalibrator(), sps, SLOPED) is None
    assert schedule_stop(one, G, head, identity, None, SLOPED) is None


# -- the drafter and the engine ---------------------------------------------------------------


def _confident_drafter(target):
    """A tiny DSpark drafter with a gated-Markov head and a confidence head (random weights: its
    confidences sit near σ(0), so sps-greedy on SLOPED verifies one or two drafts)."""
    return _ort_drafter(target, "dspark:gated-markov+confidence")


def test_a_draft_with_the_rule_ends_where_the_schedule_does():
    """Replayed one-request contexts through the drafter without and with the sps-greedy rule."""
    target = FastTarget(_model(), path="packed")
    contexts = _contexts(target, _confident_drafter(target), one_at_a_time=True)
    whole, stopped = _confident_drafter(target), _confident_drafter(target)
    scheduler, calibrator = dspark.get_scheduler("sps-greedy"), IdentityCalibrator()
    cut = 0
    with GraphCalls(whole.loop.runner) as whole_calls, GraphCalls(stopped.loop.runner) as stopped_calls:
        blocks = [(whole.draft(attrs.evolve(context, stop=None)), stopped.draft(attrs.evolve(context, stop=schedule_stop(
            context, whole.gamma, DraftHeadConfidence(), calibrator, scheduler, SLOPED)))) for context in contexts]
    for a, b in blocks:
        ell = scheduler.lengths(calibrator.calibrate(a.confidence_logits), a.valid_lengths, SLOPED)
        assert torch.equal(b.valid_lengths, ell)  # the draft ends where the whole block's schedule does
        assert torch.equal(scheduler.lengths(calibrator.calibrate(b.confidence_logits), b.valid_lengths,
                                             SLOPED), ell)
        n = int(ell[0])
        assert torch.equal(b.tokens[:, :n], a.tokens[:, :n])
        torch.testing.assert_close(b.draft_logits[:, :n], a.draft_logits[:, :n])
        torch.testing.assert_close(b.confidence_logits[:, :n], a.confidence_logits[:, :n])
        cut += int(n < a.valid_lengths[0])
    assert cut > 0 and stopped_calls.count("head") < whole_calls.count("head")  # drafts ended, head steps saved
    assert whole_calls.count("head") == whole.gamma * len(contexts)


def test_the_engine_at_one_request_with_the_rule_is_greedy_identical():
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _confident_drafter(target)
    blocks = []
    inner = drafter.draft

    def spy(context):
        block = inner(context)
        blocks.append((context.stop is not None, int(block.valid_lengths[0]), int(context.max_lengths[0])))
        return block

    drafter.draft = spy
    engine = Engine(target, drafter, scheduler="sps-greedy", cost_model=SLOPED, clock=TickClock())
    accepted = 0
    for p in PROMPTS:
        (done,) = engine.generate([torch.tensor(p)], SamplingParams.greedy(), max_new_tokens=20, progress=False)
        assert done.output_ids == greedy_decode(model, torch.tensor(p), 20)
        accepted += done.metrics["accepted"]
    assert accepted > 0
    assert all(has_rule for has_rule, _n, _room in blocks)
    assert any(n < min(4, room) for _r, n, room in blocks)  # drafts ended early


def test_sampling_at_one_request_with_the_rule_matches_the_target():
    """The rule is a stopping rule: the first two sampled tokens keep the target's joint law (T = 1,
    χ², fixed seeds; the oracle never runs the drafter), one request at a time."""
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _confident_drafter(target)
    params = SamplingParams(temperature=1.0)
    engine = Engine(target, drafter, scheduler="sps-greedy", cost_model=SLOPED, seed=11, clock=TickClock())
    prompt = torch.tensor([7, 13, 11, 7, 13, 11, 7, 13])
    out = [engine.generate([prompt], params, max_new_tokens=3, progress=False)[0] for _ in range(1500)]
    tokens = torch.tensor([c.output_ids[:2] for c in out])
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params),
                             "schedule stop / T1", exact_support=False)
    assert sum(c.metrics["accepted"] for c in out) > 0
