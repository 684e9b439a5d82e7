"""The draft gate on machines whose step times are known (issue: never slower than plain decoding).

The engine reads time through its ``clock``; here that is a virtual clock which the target advances
by a known verification cost t(B) per step and the drafter by a known draft time per round, so the
measured rates are exact and the tests are deterministic (no wall-clock timing). The drafter is an
oracle over the tiny target's own greedy decode, right up to a set number of positions per round:
the acceptance it yields is known too.

* Verification cost proportional to the tokens verified (bf16 emulated on an AVX2-only CPU, in
  the extreme): no acceptance can make drafting pay, and the gated engine must stay within 2 % of
  plain decoding's time — it may probe, rarely.
* Verification cost affine in the tokens, drafting losing by a few per cent: the gate must find out
  from the measured rates and stay within 2 % of plain.
* Flat verification cost (what AVX-512-BF16 gives a 135M model): drafting pays and the gate must
  keep drafting.
* Flat cost, content that changes between requests (a "chat" request on which drafting loses,
  then requests on which it wins): the gate must cut the losing request and still draft the
  winning ones — faster than both plain decoding and drafting every round.
In every case the output is the target's own greedy decode.
"""

from __future__ import annotations

import pytest
import torch

from dspark.cost_models import SPSTableCostModel
from dspark.engine import Engine
from dspark.gate_forecast import GatePrior
from dspark.gating import DraftGate
from dspark.targets import HFTarget
from dspark.types import DraftBlock, SamplingParams
from helpers import greedy_decode, tiny_causal_lm

GAMMA = 7
C = 0.010  # seconds of one plain step (one request, one token)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedTarget:
    """An HFTarget whose verification advances the clock by t(B), B = Σ (1 + ℓ_r) (packed)."""

    def __init__(self, inner: HFTarget, clock: VirtualClock, step_seconds) -> None:
        self.inner, self.clock, self.step_seconds = inner, clock, step_seconds

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, request_ids, tokens, lengths):
        out = self.inner.verify(request_ids, tokens, lengths)
        self.clock.now += self.step_seconds(int((lengths + 1).sum()))
        return out


class OracleDrafter:
    """Drafts the target's greedy continuation, correct for the first ``right(round)`` positions
    (later ones are shifted to a wrong token); confident where correct. Costs ``seconds`` per round."""

    name = "oracle"
    target_layer_ids, timings = (), {}  # reads no target features
    confidence_model = None  # the engine's default, draft-head

    def __init__(self, model, clock: VirtualClock, seconds: float, right) -> None:
        self.model, self.clock, self.seconds, self.right = model, clock, seconds, right
        self.gamma, self.vocab_size = GAMMA, model.config.vocab_size
        self.rounds = 0

    def draft(self, ctx) -> DraftBlock:
        R, V = len(ctx.request_ids), self.vocab_size
        tokens = torch.empty(R, GAMMA, dtype=torch.long)
        conf = torch.empty(R, GAMMA)
        for r, ids in enumerate(ctx.token_ids):
            cont = torch.tensor(greedy_decode(self.model, ids, GAMMA))  # [γ]
            k = self.right(self.rounds)
            cont[k:] = (cont[k:] + 1) % V
            tokens[r] = cont
            conf[r] = torch.where(torch.arange(GAMMA) < k, 4.0, -4.0)
        self.rounds += 1
        self.clock.now += self.seconds
        q = torch.nn.functional.one_hot(tokens, V).float()  # [R, γ, V]
        return DraftBlock(tokens, q, torch.full((R,), GAMMA), conf)

    def release(self, request_id: str) -> None:
        pass


PROMPTS = [torch.tensor([1, 5, 9, 2]), torch.tensor([3, 3, 7]), torch.tensor([8, 1, 4, 4, 6])]
NEW = 150


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(vocab_size=64, max_positions=512)


def _run(model, step_seconds, draft_seconds, right, drafter: bool, gate: bool, prompts=None, **gate_options):
    """Virtual seconds to decode PROMPTS one after another (concurrency 1), and the engine."""
    prompts = PROMPTS if prompts is None else prompts
    clock = VirtualClock()
    target = TimedTarget(HFTarget(model), clock, step_seconds)
    cost = SPSTableCostModel.from_points({q: step_seconds(q) for q in range(1, GAMMA + 2)}, accounting="packed")
    engine = Engine(target, OracleDrafter(model, clock, draft_seconds, right) if drafter else None,
                    cost_model=cost, draft_gate=DraftGate(**gate_options) if gate else None, clock=clock)
    outputs = []
    for p in prompts:
        (c,) = engine.generate([p], SamplingParams.greedy(), max_new_tokens=NEW, progress=False)
        outputs.append(c.output_ids)
    for p, out in zip(prompts, outputs):
        assert out == greedy_decode(model, p, len(out)), "speculative output differs from the target's greedy decode"
    return clock.now, engine


def _drafted(engine) -> int:
    return engine.rounds - engine.draft_gate.skipped_rounds


def test_proportional_cost_gate_stays_within_two_percent_of_plain(model):
    """t(q) = q · C: even a drafter right at every position cannot pay (it commits ≤ q tokens for
    q · C plus its own time), so the gate stops at once and probes only rarely."""
    linear = lambda q: C * q  # noqa: E731
    plain, _ = _run(model, linear, 0.5 * C, lambda i: GAMMA, drafter=False, gate=False)
    gated, engine = _run(model, linear, 0.5 * C, lambda i: GAMMA, drafter=True, gate=True)
    assert gated <= 1.02 * plain, f"gated {gated:.3f} s vs plain {plain:.3f} s"
    assert _drafted(engine) <= 4 and engine.draft_gate.hopeless_rounds >= 1
    ungated, _ = _run(model, linear, 0.5 * C, lambda i: GAMMA, drafter=True, gate=False)
    assert ungated > 1.3 * plain  # what the gate saves: drafting every round


def test_affine_cost_losing_drafter_gate_stays_within_two_percent_of_plain(model):
    """t(q) = C · (0.6 + 0.4 q), one draft token accepted a round, drafting 0.8 C: the best
    schedule (ℓ = 1) commits 2 tokens in 2.2 C, 9 % slower than plain; the bound cannot tell (a
    drafter right everywhere would pay), so the gate decides from the measured rates."""
    affine = lambda q: C * (0.6 + 0.4 * q)  # noqa: E731
    plain, _ = _run(model, affine, 0.8 * C, lambda i: 1, drafter=False, gate=False)
    gated, engine = _run(model, affine, 0.8 * C, lambda i: 1, drafter=True, gate=True)
    assert gated <= 1.02 * plain, f"gated {gated:.3f} s vs plain {plain:.3f} s"
    assert engine.draft_gate.hopeless_rounds == 0 and engine.draft_gate.skipped_rounds > 0.8 * engine.rounds


def test_flat_cost_gate_keeps_drafting(model):
    """t(q) = C for every q ≤ 8: three draft tokens accepted a round (τ = 4) for 0.3 C of drafting
    pays about 3×; the gate must not stop it."""
    flat = lambda q: C  # noqa: E731
    plain, _ = _run(model, flat, 0.3 * C, lambda i: 3, drafter=False, gate=False)
    gated, engine = _run(model, flat, 0.3 * C, lambda i: 3, drafter=True, gate=True)
    assert engine.draft_gate.skipped_rounds == 0 and engine.draft_gate.hopeless_rounds == 0
    assert plain / gated > 2.5, f"speed-up {plain / gated:.2f}"


def test_flat_cost_changing_content_gate_cuts_the_losing_request_and_drafts_the_winners(model):
    """Requests 2 and 4: the drafter is never right (drafting costs 0.3 C a round for nothing);
    requests 1 and 3: right at 3 positions (τ = 4). Rounds are counted per request through the
    oracle's own round counter, so the content switches exactly at the request boundary."""
    flat = lambda q: C  # noqa: E731
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], torch.tensor([2, 7, 1, 8])]
    bounds = []  # the oracle's round index at which each request starts

    class Content:
        def __call__(self, i):
            k = sum(1 for b in bounds if b <= i) - 1  # the request this round belongs to
            return 0 if k in (1, 3) else 3

    content = Content()
    runs = {}
    for name, drafter, gate in (("plain", False, False), ("always", True, False), ("gated", True, True)):
        clock = VirtualClock()
        target = TimedTarget(HFTarget(model), clock, flat)
        cost = SPSTableCostModel.from_points({q: C for q in range(1, GAMMA + 2)}, accounting="packed")
        oracle = OracleDrafter(model, clock, 0.3 * C, content) if drafter else None
        engine = Engine(target, oracle, cost_model=cost, draft_gate=DraftGate() if gate else None, clock=clock)
        bounds.clear()
        for p in prompts:
            bounds.append(oracle.rounds if oracle else 0)
            (c,) = engine.generate([p], SamplingParams.greedy(), max_new_tokens=NEW, progress=False)
            assert c.output_ids == greedy_decode(model, p, len(c.output_ids))
        runs[name] = (clock.now, engine)
    plain, always, (gated, engine) = runs["plain"][0], runs["always"][0], runs["gated"]
    assert gated < 0.9 * always and gated < 0.75 * plain, (plain, always, gated)
    g = engine.draft_gate
    assert g.reopened >= 1 and g.skipped_rounds > NEW  # requests 2 and 4 cut, request 3 reopened


# -- the forecast -----------------------------------------------------------------------------


def test_prior_that_forecasts_a_loss_never_drafts(model):
    """The affine machine above, with a prior that knows it (s_1 = 1, nothing after; drafting costs
    0.8 C): the best fixed length, ℓ = 1, commits 2 tokens in 2.2 C against plain's 2 in 2 C, so the
    gate skips from the first round, without the probes the measured rule needed: exactly plain's time."""
    affine = lambda q: C * (0.6 + 0.4 * q)  # noqa: E731
    prior = GatePrior([1.0] + [0.0] * (GAMMA - 1), {1: 0.8 * C})
    plain, _ = _run(model, affine, 0.8 * C, lambda i: 1, drafter=False, gate=False)
    gated, engine = _run(model, affine, 0.8 * C, lambda i: 1, drafter=True, gate=True, prior=prior)
    assert _drafted(engine) == 0 and engine.draft_gate.predicted_skips >= 1
    assert gated == pytest.approx(plain, rel=1e-9)


def test_prior_that_forecasts_a_win_drafts_from_the_first_round(model):
    """Flat cost, three drafts right a round: a prior saying so (s = 1, 1, 1, 0, ...) forecasts
    (1 + 3) / (1 + 0.3) ≈ 3× plain, so the first round drafts and the gate never skips."""
    flat = lambda q: C  # noqa: E731
    prior = GatePrior([1.0] * 3 + [0.0] * (GAMMA - 3), {1: 0.3 * C})
    _, engine = _run(model, flat, 0.3 * C, lambda i: 3, drafter=True, gate=True, prior=prior)
    assert engine.draft_gate.skipped_rounds == 0 and engine.draft_gate.predicted_skips == 0


def test_wrong_prior_is_corrected_by_its_probes(model):
    """A prior that says drafting never pays (s = 0) on a machine where it pays 3×: one real probe
    every ``forecast_probe`` predicted-skipped rounds gathers the evidence (the calibrated
    confidences, the measured rates) that overrides it, and the run ends up well below plain's time."""
    flat = lambda q: C  # noqa: E731
    prior = GatePrior([0.0] * GAMMA, {1: 0.3 * C})
    plain, _ = _run(model, flat, 0.3 * C, lambda i: 3, drafter=False, gate=False)
    gated, engine = _run(model, flat, 0.3 * C, lambda i: 3, drafter=True, gate=True, prior=prior,
                         forecast_probe=16)
    assert engine.draft_gate.predicted_skips >= 1  # it did believe the prior at first
    assert gated < 0.75 * plain, f"gated {gated:.3f} s vs plain {plain:.3f} s"


# -- the catch-up after a skip ------------------------------------------------------------------


class IngestingOracle(OracleDrafter):
    """The oracle reading target features, as the neural drafters do: ingesting each feature row
    costs ``ingest`` seconds (reported as ``timings["ingest"]``, like DraftingLoop), so a round
    after k skipped rounds pays for k rounds of context. ``right`` reads the request's length in
    tokens (the position in the text), not the drafted-round count."""

    target_layer_ids = (0,)

    def __init__(self, *args, ingest: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ingest, self.timings = ingest, {}

    def draft(self, ctx) -> DraftBlock:
        t = self.ingest * sum(int(h.shape[0]) for h in ctx.features.hidden)
        self.clock.now += t
        self.timings = {"ingest": t}
        self.rounds = len(ctx.token_ids[0])
        return super().draft(ctx)


def test_the_catch_up_after_a_skip_is_not_charged_to_drafting(model):
    """Each request's first 40 tokens (an opening the drafter misses) make the gate skip; after
    them two drafts a round are right (drafting every round: ~1.5× plain). The probe after a
    k-round skip ingests k rounds of context (0.05 C a row). Charged to the probe, that made it a
    loss, the next skip longer and its catch-up larger: the gate drafted 15 rounds of 590 (0.985×
    plain). Judged on what drafting every round costs, it resumes after the opening."""
    step = lambda q: C * (0.95 + 0.05 * q)  # noqa: E731
    cost = SPSTableCostModel.from_points({q: step(q) for q in range(1, GAMMA + 2)}, accounting="packed")
    times = {}
    for name in ("plain", "gated"):
        clock = VirtualClock()
        oracle = IngestingOracle(model, clock, 0.3 * C, lambda n: 0 if n < 40 else 2, ingest=0.05 * C)
        engine = Engine(TimedTarget(HFTarget(model), clock, step), oracle if name == "gated" else None,
                        cost_model=cost, draft_gate=DraftGate() if name == "gated" else None, clock=clock)
        for p in PROMPTS:
            (c,) = engine.generate([p], SamplingParams.greedy(), max_new_tokens=200, progress=False)
            assert c.output_ids == greedy_decode(model, p, len(c.output_ids))
        times[name] = clock.now
    assert engine.draft_gate.skipped_rounds > 0  # the openings were cut
    assert times["plain"] / times["gated"] > 1.3, times


def test_the_prior_overhead_is_measured_on_the_cost_models_clock(model):
    """measure_draft_overhead on a machine running 1.5× slower than its profile (verification and
    drafting alike; drafting 0.3 C at the profile's speed): the overhead is the 0.3 C of drafting
    in the profile's seconds, what the forecast adds to the profile's t(B). On the wall clock it
    would also hold the slow verification's excess (0.5 · t(B) beyond plain's 0.5 · t(1)) and
    0.45 C of drafting — with the profile's t(B) that forecast a loss where drafting pays."""
    from dspark.bench.prior import measure_draft_overhead

    step = lambda q: C * (0.9 + 0.1 * q)  # noqa: E731
    clock = VirtualClock()
    slow = lambda now: 1.5  # noqa: E731
    cost = SPSTableCostModel.from_points({q: step(q) for q in range(1, GAMMA + 2)}, accounting="packed")
    target = TimedTarget(HFTarget(model), clock, lambda q: slow(clock.now) * step(q))
    drafter = OracleDrafter(model, clock, 1.5 * 0.3 * C, lambda i: 2)
    out = measure_draft_overhead(target, drafter, PROMPTS, [1, 2], cost, rounds=3, passes=1, clock=clock)
    assert out == pytest.approx({1: 0.3 * C, 2: 0.3 * C}, rel=1e-6)


# -- plain decoding runs its steps back to back ---------------------------------------------------


class WarmTarget(TimedTarget):
    """A target whose one-token step right after another one-token step, with no drafter between,
    costs ``warm`` seconds (its weights and graph still warm in the caches); every other step costs
    t(B) — as a CPU target measured."""

    def __init__(self, inner: HFTarget, clock: VirtualClock, step_seconds, warm: float) -> None:
        super().__init__(inner, clock, step_seconds)
        self.warm = warm
        clock.last_plain = False  # the drafter clears it: a step after drafting runs cold

    def verify(self, request_ids, tokens, lengths):
        out = self.inner.verify(request_ids, tokens, lengths)
        plain = bool((lengths == 0).all())
        self.clock.now += self.warm if plain and self.clock.last_plain else self.step_seconds(int((lengths + 1).sum()))
        self.clock.last_plain = plain
        return out


class ColdingOracle(OracleDrafter):
    def draft(self, ctx) -> DraftBlock:
        self.clock.last_plain = False
        return super().draft(ctx)


@pytest.mark.parametrize("recorded", [True, False])
def test_the_gate_compares_drafting_with_plain_steps_run_back_to_back(model, recorded):
    """Flat cost C a step after another shape, 0.8 C a one-token step right after one; one draft
    right a round for 0.8 C of drafting: a drafted round commits 2 tokens in 1.8 C (1.11 / C),
    plain decoding 1 in 0.8 C (1.25 / C). With the profile's back-to-back plain step (``recorded``)
    the gate compares drafting with 1.25 / C and stays within 3 % of plain. From the profile's
    points alone it read plain decoding as 1 / C — and the speed factor of the plain rounds it ran,
    0.8 C measured against C modelled, put them back on that clock — and drafted on, 12 % slower
    than plain (the AMX Xeon's bench at 4 requests: 13 %)."""
    flat = lambda q: C  # noqa: E731
    profile = {"device": "test", "model": "tiny", "dtype": "float32", "date": "2026-12-07", "accounting": "packed",
               "points": [{"batch_size": q, "step_seconds": C} for q in range(1, GAMMA + 2)]}
    if recorded:
        profile["plain_steps"] = [{"context": 0, "num_requests": 1, "step_seconds": 0.8 * C}]
    cost = SPSTableCostModel(profile)
    times = {}
    for name in ("plain", "gated"):
        clock = VirtualClock()
        oracle = ColdingOracle(model, clock, 0.8 * C, lambda i: 1)
        engine = Engine(WarmTarget(HFTarget(model), clock, flat, 0.8 * C), oracle if name == "gated" else None,
                        cost_model=cost, draft_gate=DraftGate() if name == "gated" else None, clock=clock)
        for p in PROMPTS:
            (c,) = engine.generate([p], SamplingParams.greedy(), max_new_tokens=NEW, progress=False)
            assert c.output_ids == greedy_decode(model, p, len(c.output_ids))
        times[name] = clock.now
    ratio = times["gated"] / times["plain"]
    if recorded:
        assert ratio <= 1.03, times
        assert engine.draft_gate.skipped_rounds > 0.8 * engine.rounds
    else:
        assert ratio > 1.08, times  # what the back-to-back record mends
