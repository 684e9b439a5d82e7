"""Scheduler properties (hypothesis) and behaviour at low load and saturation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspark
from dspark.cost_models import SPSTableCostModel
from dspark.schedulers import summarise, survival


def affine(t0: float, slope: float, accounting: str = "packed", top: int = 4096):
    return SPSTableCostModel.from_points({1: t0 + slope, top: t0 + slope * top}, accounting=accounting)


@st.composite
def batches(draw):
    R = draw(st.integers(1, 24))
    gamma = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(R, gamma, generator=g) ** draw(st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    valid = torch.randint(0, gamma + 1, (R,), generator=g)
    return c, valid


COSTS = {
    "flat": affine(0.05, 0.0),
    "cpu": dspark.get_cost_model("sps-table", accounting="packed"),
    "cpu-padded": dspark.get_cost_model("sps-table"),
    "steep": affine(0.0, 0.01),
    "staircase": SPSTableCostModel.from_points({8: 0.02, 16: 0.03, 32: 0.05, 64: 0.09}, interpolation="step"),
}
SCHEDULERS = [("full", {}), ("fixed", {"k": 2}), ("threshold", {"threshold": 0.6}),
              ("threshold", {"threshold": 0.3, "mode": "survival"}), ("sps-greedy", {})]


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(sorted(COSTS)), st.sampled_from(range(len(SCHEDULERS))))
def test_schedule_invariants(batch, cost_name, idx):
    c, valid = batch
    name, cfg = SCHEDULERS[idx]
    cm = COSTS[cost_name]
    sch = dspark.get_scheduler(name, **cfg).schedule(c, valid, cm)
    R, gamma = c.shape
    assert sch.lengths.shape == (R,)
    assert bool((sch.lengths >= 0).all()) and bool((sch.lengths <= valid).all())
    a = survival(c, valid)
    torch.testing.assert_close(sch.survival, a)
    tau, B, theta = summarise(a, sch.lengths, cm)
    assert math.isclose(sch.expected_tokens, tau, rel_tol=1e-5)
    assert sch.batch_size == B == cm.batch_size(sch.lengths)
    assert math.isclose(sch.expected_throughput, theta, rel_tol=1e-5)
    assert tau >= R


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(sorted(COSTS)))
def test_sps_greedy_is_a_greedy_optimum_never_below_plain_decoding(batch, cost_name):
    c, valid = batch
    cm = COSTS[cost_name]
    sch = dspark.get_scheduler("sps-greedy").schedule(c, valid, cm)
    R = c.shape[0]
    plain = R * float(cm.sps(torch.tensor([cm.batch_size(torch.zeros(R, dtype=torch.long))]))[0])
    assert sch.expected_throughput >= plain * (1 - 1e-9)
    # Prefix contiguity: within a request the admitted candidates are exactly positions 1..ℓ_r,
    # i.e. every admitted a is ≥ every non-admitted valid a of the same request.
    a = sch.survival
    for r in range(R):
        lr, vr = int(sch.lengths[r]), int(valid[r])
        if 0 < lr < vr:
            assert float(a[r, lr - 1]) >= float(a[r, lr])


@settings(max_examples=100, deadline=None)
@given(batches(), st.floats(0.0, 0.02), st.floats(1.0, 20.0))
def test_budget_shrinks_as_sps_steepens(batch, slope, factor):
    c, valid = batch
    gentle = dspark.get_scheduler("sps-greedy").schedule(c, valid, affine(0.05, slope))
    steep = dspark.get_scheduler("sps-greedy").schedule(c, valid, affine(0.05, slope * factor))
    assert steep.batch_size <= gentle.batch_size
    assert bool((steep.lengths <= gentle.lengths).all())


def test_low_load_verifies_everything_with_positive_survival():
    c = torch.tensor([[0.9, 0.8, 0.1, 0.5], [0.99, 0.0, 0.9, 0.9]])
    sch = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=COSTS["flat"])
    assert sch.lengths.tolist() == [4, 1]


def test_saturation_falls_back_to_mtp1_then_plain_decoding():
    g = torch.Generator().manual_seed(0)
    c = 0.6 + 0.4 * torch.rand(128, 7, generator=g)
    cpu = COSTS["cpu"]  # knee: 108 ms at 16, 609 ms at 128 tokens
    assert dspark.get_scheduler("sps-greedy").schedule(c[:2], cost_model=cpu).lengths.min() >= 3
    busy = dspark.get_scheduler("sps-greedy").schedule(c[:64], cost_model=cpu)
    assert int(busy.lengths.max()) <= 1
    # Step time proportional to B: nothing beats plain decoding.
    prop = affine(0.0, 0.01)
    assert int(dspark.get_scheduler("sps-greedy").schedule(c, cost_model=prop).lengths.sum()) == 0


def test_padded_accounting_prices_the_longest_prefix():
    c = torch.tensor([[0.95] * 4, [0.2] * 4])
    packed = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=affine(0.05, 0.01, "packed"))
    padded = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=affine(0.05, 0.01, "padded"))
    assert padded.batch_size == 2 * (1 + int(padded.lengths.max()))
    assert packed.batch_size == 2 + int(packed.lengths.sum())


def test_threshold_modes_and_fixed():
    c = torch.tensor([[0.9, 0.7, 0.9, 0.9]])
    assert dspark.get_scheduler("threshold", threshold=0.8).schedule(c).lengths.tolist() == [1]
    assert dspark.get_scheduler("threshold", threshold=0.6).schedule(c).lengths.tolist() == [4]
    # survival 0.9, 0.63, 0.567, 0.51
    s = dspark.get_scheduler("threshold", threshold=0.55, mode="survival").schedule(c)
    assert s.lengths.tolist() == [3]
    assert dspark.get_scheduler("fixed", k=0).schedule(c).lengths.tolist() == [0]
    assert dspark.get_scheduler("full").schedule(c, torch.tensor([2])).lengths.tolist() == [2]


def test_bad_scheduler_input_messages():
    sched = dspark.get_scheduler("sps-greedy")
    with pytest.raises(ValueError, match="needs a cost model"):
        sched.schedule(torch.rand(2, 3))
    with pytest.raises(ValueError, match="calibrated probabilities"):
        sched.schedule(torch.randn(2, 3) * 5, cost_model=COSTS["flat"])
    with pytest.raises(ValueError, match="valid_lengths"):
        sched.schedule(torch.rand(2, 3), torch.tensor([1, 4]), COSTS["flat"])
    with pytest.raises(ValueError, match="scheduler 'fixed'"):
        dspark.get_scheduler("fixed", k=-1)
    with pytest.raises(ValueError, match="did you mean 'sps-greedy'"):
        dspark.get_scheduler("sps-gredy")
