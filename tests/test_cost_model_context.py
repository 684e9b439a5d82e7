"""Cost models over (tokens, KV context): profiles with curves at several contexts, the roofline's
KV-read term (R · context · KV bytes for a bound model), the binding memoised by (context, R), and
the engine and the simulator binding their cost model to each round's context."""

from __future__ import annotations

import math

import pytest
import torch

import dspark
from dspark.bench import TimeModel, Trace, parse_scheduler_spec, simulate_level
from dspark.cost_models import ProfileError, RooflineCostModel, SPSProfile, SPSTableCostModel
from dspark.cost_models.context import ContextBinding
from dspark.protocols import ContextAwareCostModel
from dspark.targets import HFTarget
from helpers import greedy_decode, tiny_causal_lm

BASE = {"device": "test", "model": "tiny", "dtype": "float32", "date": "2026-11-30", "accounting": "packed"}
FLAT10 = [{"batch_size": 1, "step_seconds": 0.010}, {"batch_size": 64, "step_seconds": 0.010}]
FLAT20 = [{"batch_size": 1, "step_seconds": 0.020}, {"batch_size": 64, "step_seconds": 0.020}]


def two_curves() -> SPSTableCostModel:
    return SPSTableCostModel(SPSProfile.from_json({**BASE, "points": FLAT10, "context": 64,
                                                   "contexts": [{"context": 256, "points": FLAT20}]}))


def test_profile_with_contexts_round_trips_and_old_profiles_are_unchanged():
    p = SPSProfile.from_json({**BASE, "points": FLAT10, "context": 64, "contexts": [{"context": 256, "points": FLAT20}]})
    assert SPSProfile.from_json(p.to_dict()) == p
    assert [c for c, _ in p.curves()] == [64, 256]
    old = SPSProfile.from_json({**BASE, "points": FLAT10})
    assert "context" not in old.to_dict() and "contexts" not in old.to_dict()


@pytest.mark.parametrize("bad, match", [
    ({"contexts": [{"context": 256, "points": FLAT20}]}, "contexts needs context"),
    ({"context": 64, "contexts": [{"context": 64, "points": FLAT20}]}, "measured twice"),
    ({"context": -1}, "context must be an integer >= 0"),
    ({"context": 64, "contexts": [{"context": 128}]}, r"contexts\[0\] must be \{context, points, batch_overhead\?\}"),
    ({"context": 64, "contexts": [{"context": 128, "points": []}]}, r"contexts\[0\]: points must hold"),
])
def test_bad_context_fields_are_one_sentence(bad, match):
    with pytest.raises(ProfileError, match=match):
        SPSProfile.from_json({**BASE, "points": FLAT10, **bad})


def test_step_time_is_linear_in_context_between_curves():
    cm = two_curves()
    B = torch.tensor([1, 8, 64])
    for ctx, want in ((32, 0.010), (64, 0.010), (160, 0.015), (256, 0.020), (448, 0.030)):
        got = cm.at_context(ctx).step_seconds(B)
        torch.testing.assert_close(got, torch.full((3,), want, dtype=torch.float64)), ctx
    assert cm.step_seconds(B).tolist() == [0.010] * 3  # unbound: the profile's own points
    assert cm.at_context(170).context == 176.0  # rounded to 16 tokens


def test_beyond_the_last_context_the_step_time_still_rises_with_b():
    """Curves at 64 and 128 tokens whose small batches grow faster with the context than the large
    ones: continued per B to 512 tokens, B = 1 would cost more than B = 8. The monotone fit keeps
    the time non-decreasing in B there, and never below the last measured curve."""
    lo = [{"batch_size": 1, "step_seconds": 0.010}, {"batch_size": 8, "step_seconds": 0.030}]
    hi = [{"batch_size": 1, "step_seconds": 0.020}, {"batch_size": 8, "step_seconds": 0.032}]
    profile = SPSProfile.from_json({**BASE, "points": lo, "context": 64, "contexts": [{"context": 128, "points": hi}]})
    B = torch.arange(1, 17, dtype=torch.float64)
    for ctx in (160, 512, 2048):
        got = SPSTableCostModel(profile).at_context(ctx).step_seconds(B)
        assert bool((got[1:] >= got[:-1]).all()), (ctx, got.tolist())
        assert bool((got >= SPSTableCostModel(profile).at_context(128).step_seconds(B) - 1e-12).all())
    raw = SPSTableCostModel(profile, fit="none").at_context(512).step_seconds(torch.tensor([1.0, 8.0]))
    assert raw[0] > raw[1]  # as measured and continued: the dip the fit removes
    torch.testing.assert_close(SPSTableCostModel(profile).at_context(512).step_seconds(torch.tensor([1.0, 8.0])),
                               torch.full((2,), (raw[0] + raw[1]).item() / 2, dtype=torch.float64))


def test_one_curve_profiles_and_kv_free_rooflines_ignore_context():
    one = SPSTableCostModel.from_points({1: 0.01, 8: 0.02})
    assert one.at_context(4096) is one
    roof = RooflineCostModel(num_params=1e8, memory_bandwidth=1e12, peak_flops=1e14)
    assert roof.at_context(4096) is roof
    assert isinstance(one, ContextAwareCostModel) and isinstance(roof, ContextAwareCostModel)


def test_roofline_kv_term_grows_with_context():
    roof = RooflineCostModel(num_params=1e8, memory_bandwidth=1e12, peak_flops=1e15, kv_bytes_per_token=1e5)
    B = torch.tensor([16])
    t0, t1, t2 = (roof.at_context(c).step_seconds(B).item() for c in (0, 1024, 2048))
    assert t0 < t1 < t2 and t2 - t1 == pytest.approx(t1 - t0)  # bytes read: linear in the context
    assert t1 - t0 == pytest.approx(16 * 1024 * 1e5 / 1e12)


def _kv_roofline(**options) -> RooflineCostModel:
    # 1e9 params × 2 bytes = 2e9 bytes of weights at 1e12 B/s; 1e5 KV bytes per token of context.
    return RooflineCostModel(num_params=1e9, memory_bandwidth=1e12, peak_flops=1e15, kv_bytes_per_token=1e5,
                             **options)


def test_bound_roofline_reads_each_requests_kv_cache_once():
    """R requests over 1024 tokens each: the step reads the weights and R · 1024 · 1e5 KV bytes,
    whatever B (memory-bound here: B · 2e9 / 1e15 ≤ 1.3e-4 s)."""
    bound = _kv_roofline().at_context(1024, 8)
    assert (bound.context_length, bound.num_requests) == (1024.0, 8)
    B = torch.tensor([8, 16, 32, 64])
    want = (2e9 + 8 * 1024 * 1e5) / 1e12  # 2.8192 ms
    torch.testing.assert_close(bound.step_seconds(B), torch.full((4,), want, dtype=torch.float64))
    other = _kv_roofline().at_context(1024, 2).step_seconds(B)
    torch.testing.assert_close(other, torch.full((4,), (2e9 + 2 * 1024 * 1e5) / 1e12, dtype=torch.float64))


def test_unbound_roofline_charges_every_token_its_context():
    """Without R the KV read is B · context · KV bytes: an upper bound, exact when B = R."""
    unbound = _kv_roofline().at_context(1024)
    assert unbound.num_requests is None
    B = torch.tensor([1, 8, 64])
    want = torch.tensor([(2e9 + b * 1024 * 1e5) / 1e12 for b in (1, 8, 64)], dtype=torch.float64)
    torch.testing.assert_close(unbound.step_seconds(B), want)
    bound = _kv_roofline().at_context(1024, 8)
    assert bound.step_seconds(torch.tensor([8])).item() == pytest.approx(unbound.step_seconds(torch.tensor([8])).item())
    assert bound.step_seconds(torch.tensor([64])).item() < unbound.step_seconds(torch.tensor([64])).item()


def test_bound_roofline_knee():
    """Compute 2e9 FLOP/token at 1e14 FLOP/s = 2e-5 s; memory (2e9 + 4 · 1024 · 1e5) / 1e12 s: the
    knee is where B · 2e-5 meets it, flat below and linear above."""
    roof = RooflineCostModel(num_params=1e9, memory_bandwidth=1e12, peak_flops=1e14, kv_bytes_per_token=1e5)
    bound = roof.at_context(1024, 4)
    memory = (2e9 + 4 * 1024 * 1e5) / 1e12
    knee = memory / 2e-5  # 120.48
    assert bound.knee_batch_size == pytest.approx(knee)
    torch.testing.assert_close(bound.step_seconds(torch.tensor([1.0, knee, 2 * knee])),
                               torch.tensor([memory, memory, 2 * memory], dtype=torch.float64))
    # Unbound, 1e3 KV bytes per token: memory W + B · 1024 · 1e3 meets compute B · 2e-5 at
    # B = 2e-3 / (2e-5 - 1.024e-6); with 1e5 bytes per token the KV term outgrows compute: no knee.
    small = RooflineCostModel(num_params=1e9, memory_bandwidth=1e12, peak_flops=1e14, kv_bytes_per_token=1e3)
    assert small.at_context(1024).knee_batch_size == pytest.approx(2e-3 / (2e-5 - 1.024e-6))
    assert roof.at_context(1024).knee_batch_size == math.inf
    assert roof.at_context(1024, 4).knee_batch_size < math.inf


class Counting:
    """A context-aware cost model that counts its bindings and binds a roofline."""

    def __init__(self) -> None:
        self.calls: list = []
        self.name, self.accounting = "counting", "packed"

    def at_context(self, context, num_requests=None):
        self.calls.append((context, num_requests))
        return _kv_roofline().at_context(context, num_requests)


def test_context_binding_memoises_by_context_bucket_and_requests():
    cm = Counting()
    bind = ContextBinding(cm)
    a = bind(100, 4)  # bucket 96 (100 / 16 = 6.25 → 6)
    assert bind(98.5, 4) is a and cm.calls == [(96, 4)]  # same bucket, same R: memoised
    b = bind(100, 8)
    assert b is not a and cm.calls == [(96, 4), (96, 8)]  # same bucket, other R: bound again
    assert (a.num_requests, b.num_requests) == (4, 8) and a.context_length == b.context_length == 96.0
    assert b.step_seconds(torch.tensor([8])).item() > a.step_seconds(torch.tensor([8])).item()
    bind(120, 4)
    assert cm.calls[-1] == (128, 4)
    small = ContextBinding(Counting(), max_entries=2)
    small(16, 1), small(16, 2), small(16, 3)  # the third clears the full memo
    assert len(small._bound) == 1
    plain = SPSTableCostModel.from_points({1: 0.01, 8: 0.02})
    assert ContextBinding(None)(64, 1) is None and ContextBinding(object)(64, 1) is object
    assert ContextBinding(plain)(64, 3) is plain  # one curve: the same model at every (context, R)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_simulated_plain_decoding_pays_the_kv_term_of_its_prompts(concurrency):
    """Plain decoding with a bound H200 roofline for Llama-3.1-8B: round k of R requests reads the
    weights once and R · c_k · 131072 KV bytes, c_k the mean context rounded to 16 tokens; longer
    prompts are slower by exactly that term."""
    n_tok = 24
    weights = 8_030_261_248 * 2
    kv = 2 * 32 * 8 * 128 * 2  # K and V × layers × KV heads × head_dim × bf16
    cm = dspark.get_cost_model("roofline", gpu="h200", target="llama-3.1-8b")

    def makespan(prompt_tokens: int) -> float:
        trace = Trace(torch.zeros(3, 2), torch.full((3,), 2), torch.zeros(3, dtype=torch.long), n_tok, prompt_tokens)
        run = simulate_level([trace], parse_scheduler_spec("plain"), scheduler=None,
                             calibrator=dspark.get_calibrator("identity"), cost_model=cm, time_model=TimeModel(),
                             concurrency=concurrency, num_requests=concurrency, max_new_tokens=n_tok)
        assert [r.num_requests for r in run.rounds] == [concurrency] * n_tok
        assert [r.context for r in run.rounds] == [prompt_tokens + k for k in range(n_tok)]
        return run.makespan

    def context(prompt_tokens: int, k: int) -> int:
        return 16 * round((prompt_tokens + k) / 16)

    R = concurrency
    for prompt in (64, 8000):
        want = sum((weights + R * context(prompt, k) * kv) / 4.8e12 for k in range(n_tok))
        assert makespan(prompt) == pytest.approx(want, rel=1e-12)
    extra = sum(R * (context(8000, k) - context(64, k)) * kv / 4.8e12 for k in range(n_tok))
    assert makespan(8000) - makespan(64) == pytest.approx(extra, rel=1e-9)
    assert extra > 0.06 * makespan(64)  # 8000 tokens of bf16 KV: 1 GB a request against 16 GB of weights


class Spy:
    """A context-aware cost model that records every context it is bound to."""

    def __init__(self, inner: SPSTableCostModel, seen: list) -> None:
        self.inner, self.seen = inner, seen
        self.name, self.accounting = "spy", inner.accounting

    def at_context(self, context, num_requests=None):
        self.seen.append((context, num_requests))
        return self.inner.at_context(context, num_requests)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_engine_binds_its_cost_model_to_each_rounds_context():
    model = tiny_causal_lm()
    prompt = torch.tensor([2, 9, 4, 4, 11, 2, 9, 4] * 8)  # 64 tokens
    expected = greedy_decode(model, prompt, 40)
    seen: list = []
    target = HFTarget(model)
    drafter = dspark.get_drafter("ngram", vocab_size=model.config.vocab_size, gamma=4)
    engine = dspark.Engine(target, drafter, scheduler="sps-greedy", cost_model=Spy(two_curves(), seen))
    out = engine.generate([prompt], max_new_tokens=40, progress=False)
    assert out[0].output_ids == expected
    contexts = [c for c, _ in seen]
    assert contexts and contexts == sorted(contexts) and contexts[0] == 64 and contexts[-1] >= 96
    assert all(c % 16 == 0 and r == 1 for c, r in seen)


def test_profile_from_shapes_keeps_a_curve_per_timed_context():
    """Synthetic shapes t = bias + α(R) + θ(B) + k·context·B: the main context splits additively, each
    other context becomes a curve, and the sps-table model reproduces every shape at its context."""
    from dspark.profiling import profile_from_shapes

    def t(ctx, R, w):
        B = R * w
        return 0.01 + 0.002 * (R - 1) + 0.0005 * B + 1e-6 * ctx * B

    times = {(ctx, R, w): t(ctx, R, w) for ctx in (128, 512, 1024) for R in (1, 2, 4) for w in (1, 2, 4)}
    prof = profile_from_shapes(times, model="tiny", dtype="float32", device="test", repeats=1)
    assert prof.context == 128 and [c for c, *_ in prof.contexts] == [512, 1024]
    cm = SPSTableCostModel(prof)
    for (ctx, R, w), want in times.items():
        got = cm.at_context(ctx).step_seconds(torch.tensor([R * w])).item() + cm.batch_overhead_seconds(R)
        assert got == pytest.approx(want, rel=1e-6), (ctx, R, w)
    mid = cm.at_context(768).step_seconds(torch.tensor([8])).item() + cm.batch_overhead_seconds(2)
    assert mid == pytest.approx(t(768, 2, 4), rel=1e-6)  # linear in the context between curves


def test_bench_sim_target_takes_the_shapes_parameters_and_kv_bytes():
    from dspark.bench.costs import simulation_cost_model
    from dspark.bench.run import BenchOptions
    from dspark.cli import build_parser

    opts = BenchOptions(sim_cost_model="h200", sim_target="llama-3.1-8b", sim_params=1e9)
    cm, desc = simulation_cost_model(opts, None)
    assert cm.num_params == 8_030_261_248 and cm.kv_bytes_per_token == 131072.0 and cm.accounting == "packed"
    assert "llama-3.1-8b" in desc and "--sim-params ignored" in desc and "R · context · KV bytes" in desc
    old, old_desc = simulation_cost_model(BenchOptions(sim_cost_model="h200", sim_params=8e9), None)
    assert old.num_params == 8e9 and old.kv_bytes_per_token == 0.0  # without --sim-target: as before
    assert old_desc == "roofline h200 (8e+09 params, 0.0 ms launch overhead, packed)"
    argv = ["bench", "--sim-cost-model", "h100", "--sim-target", "qwen3-8b"]
    assert BenchOptions.from_namespace(build_parser().parse_args(argv)).sim_target == "qwen3-8b"
    with pytest.raises(ValueError, match="unknown target shape 'gpt-9'"):
        BenchOptions(sim_cost_model="h200", sim_target="gpt-9")
    with pytest.raises(ValueError, match="--sim-target needs a roofline preset"):
        BenchOptions(sim_target="llama-3.1-8b")


def test_each_timed_context_gets_its_own_request_overhead():
    """Shapes with a KV read per request, t ∋ k·R·context: one α(R) (the main context's) would misread
    every other context; each context's own split reproduces every shape there, between curves
    the bound model is linear in the context, and the JSON form keeps the per-context α."""
    from dspark.profiling import profile_from_shapes

    def t(ctx, R, w):
        B = R * w
        return 0.01 + 0.002 * (R - 1) + 0.0005 * B + 1e-6 * ctx * B + 2e-5 * R * ctx

    times = {(ctx, R, w): t(ctx, R, w) for ctx in (128, 512, 1024) for R in (1, 2, 4) for w in (1, 2, 4)}
    prof = profile_from_shapes(times, model="tiny", dtype="float32", device="test", repeats=1)
    assert all(alpha for _, _, alpha in prof.contexts)
    cm = SPSTableCostModel(prof)
    for (ctx, R, w), want in times.items():
        bound = cm.at_context(ctx)
        got = bound.step_seconds(torch.tensor([R * w])).item() + bound.batch_overhead_seconds(R)
        assert got == pytest.approx(want, rel=1e-6), (ctx, R, w)
    mid = cm.at_context(768)
    assert (mid.step_seconds(torch.tensor([8])).item() + mid.batch_overhead_seconds(2)
            == pytest.approx(t(768, 2, 4), rel=1e-6))
    again = SPSProfile.from_json(prof.to_dict())
    assert again == prof and "batch_overhead" in prof.to_dict()["contexts"][0]


def test_a_curve_without_its_own_overhead_reads_the_main_one():
    """Profiles written before per-context α (curves only) still load and read the main α(R)."""
    p = SPSProfile.from_json({"device": "d", "model": "m", "dtype": "f", "date": "x", "accounting": "padded",
                              "points": FLAT20, "batch_overhead": [{"num_requests": 1, "seconds": 0.0},
                                                                   {"num_requests": 4, "seconds": 0.003}],
                              "context": 64, "contexts": [{"context": 256, "points": FLAT20}]})
    assert [a for _, a in p.overhead_curves()] == [((1, 0.0), (4, 0.003))] * 2
    assert SPSTableCostModel(p).at_context(256).batch_overhead_seconds(4) == pytest.approx(0.003)


# -- plain decoding's steps, timed back to back ----------------------------------------------------

PLAIN = [{"context": 64, "num_requests": 1, "step_seconds": 0.008}, {"context": 64, "num_requests": 4, "step_seconds": 0.011},
         {"context": 256, "num_requests": 1, "step_seconds": 0.016}, {"context": 256, "num_requests": 4, "step_seconds": 0.019}]


def test_plain_steps_round_trip_and_are_read_in_r_and_in_the_context():
    """The profile's back-to-back plain steps: linear in R between the timed R (the last slope
    beyond), linear in the context between curves; what the gate and the forecast compare drafting
    with, and k = 0 of the fixed-length rates."""
    from dspark.cost_models import fixed_length_rates, plain_step_seconds

    p = SPSProfile.from_json({**BASE, "points": FLAT10, "context": 64, "contexts": [{"context": 256, "points": FLAT20}],
                              "plain_steps": PLAIN})
    assert SPSProfile.from_json(p.to_dict()) == p and p.to_dict()["plain_steps"] == PLAIN
    cm = SPSTableCostModel(p)
    assert cm.plain_step_seconds(1) == pytest.approx(0.008)  # unbound: the profile's own context
    assert cm.plain_step_seconds(2) == pytest.approx(0.009)
    assert cm.plain_step_seconds(7) == pytest.approx(0.014)  # beyond R = 4: the last slope
    assert cm.at_context(160).plain_step_seconds(4) == pytest.approx(0.015)
    assert plain_step_seconds(cm.at_context(256), 1) == pytest.approx(0.016)
    rates = fixed_length_rates([1.0, 0.5], cm, 1)
    assert rates[0] == pytest.approx(1 / 0.008) and rates[1] == pytest.approx(2 / 0.010)
    without = SPSTableCostModel(SPSProfile.from_json({**BASE, "points": FLAT10}))  # t(B₀) + α(R), as before
    assert without.plain_step_seconds(3) == pytest.approx(0.010) == plain_step_seconds(without, 3)
    assert "plain_steps" not in without.profile.to_dict()


@pytest.mark.parametrize("bad, match", [
    ([{"context": 64, "num_requests": 0, "step_seconds": 0.01}], r"plain_steps\[0\]\.num_requests must be an integer >= 1"),
    ([{"context": 64, "num_requests": 1, "step_seconds": -1}], r"plain_steps\[0\]\.step_seconds must be a finite number > 0"),
    ([{"context": "x", "num_requests": 1, "step_seconds": 0.01}], r"plain_steps\[0\]\.context must be an integer >= 0"),
    ([{"context": 64, "num_requests": 1}], r"plain_steps\[0\] must be \{context, num_requests, step_seconds\}"),
    ([PLAIN[0], PLAIN[0]], r"plain_steps\[1\] repeats context 64, num_requests 1"),
    ([[64, 1]], r"plain_steps\[0\] must be a \(context, num_requests, step_seconds\) triple"),
    (5, r"plain_steps must be a list of \{context, num_requests, step_seconds\} objects, got 5"),
    ({"context": 64}, r"plain_steps must be a list"),
])
def test_bad_plain_steps_are_one_sentence(bad, match):
    with pytest.raises(ProfileError, match=match):
        SPSProfile.from_json({**BASE, "points": FLAT10, "plain_steps": bad})


def test_time_profile_times_plain_steps_back_to_back_in_the_same_sweeps():
    """``time_profile`` on a tiny target: every (context, R, 1 + ℓ) after another shape as before,
    and per (context, R) runs of ``plain_run`` one-token steps in a row (counted on the target),
    interleaved with the shapes; the profile records them and the sps-table model reads them."""
    from dspark.profiling import profile_from_shapes, time_profile

    target = HFTarget(tiny_causal_lm(vocab_size=64, max_positions=256))
    calls = []
    verify = target.verify

    def counting(ids, tokens, lengths):
        calls.append((len(ids), tokens.shape[1]))
        return verify(ids, tokens, lengths)

    target.verify = counting
    times, plain = time_profile(target, [1, 2], [1, 3], [16, 48], repeats=2, progress=False, plain_run=3)
    assert set(times) == {(c, r, w) for c in (16, 48) for r in (1, 2) for w in (1, 3)}
    assert set(plain) == {(c, r) for c in (16, 48) for r in (1, 2)} and all(s > 0 for s in plain.values())
    # per context: 3 sweeps (a warm-up and 2 timed) × (4 shapes once + 2 plain runs of 3 steps)
    assert len(calls) == 2 * 3 * (4 + 2 * 3)
    runs = sum(1 for i in range(len(calls) - 2) if calls[i] == calls[i + 1] == calls[i + 2] and calls[i][1] == 1)
    assert runs >= 2 * 3 * 2  # every plain run is three one-token steps of the same R in a row
    prof = profile_from_shapes(times, model="tiny", dtype="float32", device="test", repeats=2, plain=plain)
    assert {(c, r) for c, r, _ in prof.plain_steps} == set(plain) and "plain_steps" in prof.notes
    cm = SPSTableCostModel(prof, fit="none")  # as measured (the monotone fit would pool a fall)
    assert cm.at_context(48).plain_step_seconds(2) == pytest.approx(plain[48, 2])
    assert time_profile(target, [1], [1], [16], repeats=1, progress=False, plain_run=0)[1] == {}
