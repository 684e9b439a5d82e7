"""Cost models over (tokens, KV context): profiles with curves at several contexts, the roofline's
KV-read term, and the engine binding its cost model to each round's context."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.cost_models import ProfileError, RooflineCostModel, SPSProfile, SPSTableCostModel
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
    ({"context": 64, "contexts": [{"context": 128}]}, r"contexts\[0\] must be \{context, points\}"),
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
    assert prof.context == 128 and [c for c, _ in prof.contexts] == [512, 1024]
    cm = SPSTableCostModel(prof)
    for (ctx, R, w), want in times.items():
        got = cm.at_context(ctx).step_seconds(torch.tensor([R * w])).item() + cm.batch_overhead_seconds(R)
        assert got == pytest.approx(want, rel=1e-6), (ctx, R, w)
    mid = cm.at_context(768).step_seconds(torch.tensor([8])).item() + cm.batch_overhead_seconds(2)
    assert mid == pytest.approx(t(768, 2, 4), rel=1e-6)  # linear in the context between curves
