"""The draft gate's forecast: the best fixed draft length from the acceptance survival and the cost
model, the prior it may start from, and the survival it measures (engine-level behaviour:
tests/test_gate_machines.py)."""

from __future__ import annotations

import pytest
import torch

from dspark.cost_models import SPSTableCostModel, best_fixed_length
from dspark.gate_forecast import GatePrior
from dspark.gating import DraftGate, ObservedRound


def _cost(points, accounting="packed"):
    return SPSTableCostModel.from_points(points, accounting=accounting)


def test_best_fixed_length_matches_brute_force():
    """t(B) = 0.01 + 0.002 B (packed, no α(R)); R = 2; survival (0.8, 0.5, 0.1); drafting 4 ms.
    By hand: k = 0: 2 / 0.014 = 142.9; k = 1: 3.6 / 0.022 = 163.6; k = 2: 4.6 / 0.026 = 176.9;
    k = 3: 4.8 / 0.030 = 160.0 → k* = 2."""
    cm = _cost({b: 0.01 + 0.002 * b for b in range(1, 17)})
    k, rate = best_fixed_length([0.8, 0.5, 0.1], cm, 2, draft_seconds=0.004)
    assert k == 2 and rate == pytest.approx(4.6 / 0.026)
    # a drafting cost high enough that nothing pays: plain (k = 0) at its own rate
    k, rate = best_fixed_length([0.8, 0.5, 0.1], cm, 2, draft_seconds=0.1)
    assert k == 0 and rate == pytest.approx(2 / 0.014)
    # the per-round overhead is paid by every k, plain included
    k, rate = best_fixed_length([0.8, 0.5, 0.1], cm, 2, draft_seconds=0.1, round_overhead=0.006)
    assert k == 0 and rate == pytest.approx(2 / 0.020)


def test_gate_prior_validates_and_interpolates():
    with pytest.raises(ValueError, match="non-increasing"):
        GatePrior([0.5, 0.6], {1: 0.01})
    with pytest.raises(ValueError, match="non-increasing"):
        GatePrior([1.5], {1: 0.01})
    with pytest.raises(ValueError, match="draft_overhead"):
        GatePrior([0.5], {0: 0.01})
    with pytest.raises(ValueError, match="draft_overhead"):
        GatePrior([0.5], {})
    with pytest.raises(ValueError, match="needs 'survival'"):
        GatePrior.from_dict({"survival": [0.5]})
    p = GatePrior([0.5, 0.25], {2: 0.010, 4: 0.020, 8: 0.030})
    assert p.overhead_at(1) == 0.010  # flat below the first point
    assert p.overhead_at(3) == pytest.approx(0.015)
    assert p.overhead_at(6) == pytest.approx(0.025)
    assert p.overhead_at(16) == pytest.approx(0.050)  # along the last segment's slope
    assert GatePrior.from_dict(p.to_dict()) == p


def test_forecast_is_the_best_fixed_length_over_plain():
    cm = _cost({b: 0.01 + 0.002 * b for b in range(1, 17)})
    g = DraftGate(prior=GatePrior([0.8, 0.5, 0.1], {2: 0.004}))
    assert g.forecast(2, cm) == pytest.approx((4.6 / 0.026) / (2 / 0.014))
    assert not g.predicts_loss(2, cm) and g.should_draft(["a", "b"], cm)
    # a plain round measured 6 ms slower than the model: both rates pay it
    g.observe_round(ObservedRound(2, False, 2, 0.020), cm)
    assert g.forecast(2, cm) == pytest.approx((4.6 / 0.032) / (2 / 0.020))
    assert DraftGate().forecast(2, cm) is None  # nothing measured, no prior: no forecast


def test_measured_survival_from_calibrated_confidences_rescaled_by_acceptance():
    """Eight request-rounds whose calibrated prefix survival is (0.9, 0.6, 0.3), each verifying two
    drafts (expected accepted 1.5) and accepting 0.75 on average: half what the confidences say,
    so the measured survival is (0.45, 0.3, 0.15); the third position, never verified, is known from
    the confidences alone."""
    cm = _cost({b: 0.01 for b in range(1, 17)})
    g = DraftGate(min_evidence=8, calibration_decay=0.0)
    surv = torch.tensor([[0.9, 0.6, 0.3]] * 2)  # [R = 2, γ = 3]
    for accepted in ([1, 0], [2, 0], [1, 1], [0, 1]):  # 6 accepted of 4 · 1.5 · 2 = 12 expected
        g.observe_round(ObservedRound(2, True, 2 + sum(accepted), 0.02, lengths=torch.tensor([2, 2]),
                                      accepted=torch.tensor(accepted), survival=surv), cm)
    assert g.forecaster.survival() == pytest.approx([0.45, 0.30, 0.15])


def test_overhead_measured_elsewhere_is_scaled_by_the_full_block_step():
    """A drafted round at R = 1 spent 5 ms beyond its step: at R = 4 the forecast assumes
    5 ms · t(4 · (1 + γ)) / t(1 + γ) (the drafter's forward is a block too)."""
    cm = _cost({b: 0.01 + 0.001 * b for b in range(1, 33)})
    g = DraftGate(min_evidence=1)
    g.observe_round(ObservedRound(1, True, 2, 0.01 + 0.001 * 4 + 0.005, lengths=torch.tensor([3]), accepted=torch.tensor([1]),
                                  survival=torch.tensor([[0.5, 0.25, 0.1]])), cm)
    expected = 0.005 * (0.01 + 0.001 * 16) / (0.01 + 0.001 * 4)
    assert g.forecaster.draft_overhead(4, cm, 3) == pytest.approx(expected)
    assert g.forecaster.draft_overhead(1, cm, 3) == pytest.approx(0.005)


def test_forecast_blocks_reopening_where_drafting_cannot_pay():
    """A bucket where drafting has won (min_wins) reopens when its batch turns over — unless the
    forecast now says no draft length pays there."""
    cm = _cost({b: 0.01 * b for b in range(1, 17)})  # proportional: drafting never pays
    g = DraftGate(min_wins=1, prior=GatePrior([0.3], {2: 0.005}))
    g.wins[2] = 3
    g.skip, g._skip_for = 10, frozenset({"a", "b"})
    assert not g.should_draft(["c", "d"], cm) and g.reopened == 0
    assert g.should_draft(["e", "f"]) and g.reopened == 1  # without a cost model, no forecast: reopens


def test_one_requests_rejected_opening_does_not_replace_the_prior():
    """At R = 1 the first rounds are the opening of one answer; a drafter may miss all of it while
    it accepts often elsewhere (bench14c, c = 1). Eight rejected rounds of one request leave the
    prior's survival (the forecast still says drafting pays, so no 256-round skip follows the
    measured loss); rounds from min_requests = 4 distinct requests replace it."""
    cm = _cost({b: 0.01 + 0.0005 * b for b in range(1, 33)})
    g = DraftGate(prior=GatePrior([0.6, 0.4, 0.2], {1: 0.002}))
    surv = torch.tensor([[0.6, 0.36, 0.216]])  # [R = 1, γ = 3]
    for _ in range(8):
        assert g.should_draft(["a"], cm)
        g.observe_round(ObservedRound(1, True, 1, 0.015, draft_seconds=0.002, gamma=3, expected=1.6,
                                      lengths=torch.tensor([3]), accepted=torch.tensor([0]), survival=surv), cm)
    assert g.forecaster.survival() == pytest.approx([0.6, 0.4, 0.2])
    assert not g.predicts_loss(1, cm) and g.skip < g.hopeless_skip
    for rid in "bcd":  # three more requests, just as badly drafted: now the measurement holds
        g.should_draft([rid], cm)  # the round's request (its decision does not matter here)
        g.observe_round(ObservedRound(1, True, 1, 0.015, lengths=torch.tensor([3]), accepted=torch.tensor([0]), survival=surv), cm)
    assert g.forecaster.survival() == pytest.approx([0.0, 0.0, 0.0])
    assert g.predicts_loss(1, cm)


def test_one_slow_round_does_not_replace_the_prior_overhead():
    """A request's first drafted round also ingests its whole prompt: at R = 1 that one round must
    not replace the prior's overhead (it would forecast a loss and skip 512 rounds, bench15a);
    min_evidence = 8 request-rounds do."""
    cm = _cost({b: 0.01 for b in range(1, 33)})  # flat: verifying drafts is free
    g = DraftGate(prior=GatePrior([0.5, 0.3], {1: 0.002}))
    surv = torch.tensor([[0.5, 0.3]])
    g.should_draft(["a"], cm)
    g.observe_round(ObservedRound(1, True, 2, 0.01 + 0.030, lengths=torch.tensor([2]), accepted=torch.tensor([1]), survival=surv), cm)
    assert g.forecaster.draft_overhead(1, cm, 2) == pytest.approx(0.002) and not g.predicts_loss(1, cm)
    for _ in range(7):
        g.observe_round(ObservedRound(1, True, 2, 0.01 + 0.030, lengths=torch.tensor([2]), accepted=torch.tensor([1]), survival=surv), cm)
    # 8 request-rounds, but no plain round yet: their excess may be the engine's own per-round work,
    # which a plain round pays too, so the prior still holds
    assert g.forecaster.draft_overhead(1, cm, 2) == pytest.approx(0.002) and not g.predicts_loss(1, cm)
    g.observe_round(ObservedRound(1, False, 1, 0.01 + 0.004), cm)  # a plain round: 4 ms beyond t(1)
    assert g.forecaster.draft_overhead(1, cm, 2) == pytest.approx(0.026) and g.predicts_loss(1, cm)


def test_the_engines_per_round_work_is_not_charged_to_drafting():
    """bench29, c = 2: before any plain round the measured drafted excess over t(B) + α(R) holds
    the engine's per-round work (sampling, bookkeeping) that plain rounds pay too. With it charged
    to drafting the forecast said "loss" after 5 drafted rounds and the gate skipped the rest of
    the run, where fixed k = 7 was 1.17× plain. Measured plain rounds with the same excess cancel it."""
    cm = _cost({b: 0.020 + 0.0005 * b for b in range(1, 33)})
    prior = GatePrior([0.5, 0.25, 0.12], {2: 0.004})
    g = DraftGate(prior=prior)
    surv = torch.tensor([[0.5, 0.25, 0.12]] * 2)
    work = 0.008  # the engine's own per-round seconds, drafted or not
    for _ in range(5):
        assert g.should_draft(["a", "b"], cm)
        g.observe_round(ObservedRound(2, True, 4, 0.024 + 0.004 + work,  # t(B = 8) + overhead + work
                                      lengths=torch.tensor([3, 3]), accepted=torch.tensor([1, 1]), survival=surv), cm)
    assert g.forecaster.draft_overhead(2, cm, 3) == pytest.approx(0.004) and not g.predicts_loss(2, cm)
    for _ in range(3):
        g.observe_round(ObservedRound(2, False, 2, 0.021 + work), cm)
    assert g.forecaster.draft_overhead(2, cm, 3) == pytest.approx(0.004, abs=1e-9)
    assert not g.predicts_loss(2, cm) and g.forecast(2, cm) > 1.0


def test_one_requests_rejected_opening_does_not_stop_drafting_that_the_forecast_says_pays():
    """bench30, c = 1, r0: the first request opened with drafts the drafter missed, the measured
    rates said "loss" after 13 drafted rounds and the gate never drafted again (0.81× plain, where
    the other repeats drafted and ran 1.13–1.18×). Where the forecast says drafting pays, the
    measured rates need min_requests = 4 distinct requests before they may stop it; once they
    have them, a loss that persists does stop it."""
    cm = _cost({b: 0.01 + 0.0005 * b for b in range(1, 33)})
    prior = GatePrior([0.6, 0.4, 0.2], {1: 0.002})
    surv = torch.tensor([[0.6, 0.36, 0.216]])  # [R = 1, γ = 3]

    def rejected_round(g, rid):
        drafting = g.should_draft([rid], cm)
        g.observe_round(ObservedRound(1, True, 1, 0.015, draft_seconds=0.002, gamma=3, expected=1.6,
                                      lengths=torch.tensor([3]), accepted=torch.tensor([0]), survival=surv), cm)
        return drafting

    g = DraftGate(prior=prior)
    assert all(rejected_round(g, "a") for _ in range(20))  # one request: it keeps drafting
    assert g.skip == 0 and not g.predicts_loss(1, cm)
    for rid in "bc":
        assert all(rejected_round(g, rid) for _ in range(3))
    rejected_round(g, "d")  # the fourth request: the measurement now holds, and it stops
    assert g.skip > 0 and not g.should_draft(["d"], cm)
    # without a prior (no forecast yet), the measured rates decide as before: 8 request-rounds
    g = DraftGate()
    for _ in range(8):
        rejected_round(g, "a")
    assert g.skip > 0


# -- the machine's speed drifts: rounds on the cost model's clock ------------------------------------


def _drift_rounds(gate: DraftGate, cm, slow: float) -> bool:
    """Eight plain rounds at the profile's speed, then drafted rounds with the machine ``slow``×
    slower: R = 2, ℓ = 1 each (B = 4 packed), τ̂ 2 a request, drafting 4 ms (profile's clock).
    On the profile's clock drafting pays 4 / 0.022 against plain's 2 / 0.014 (1.27×) at any speed.
    Returns whether the gate decided to skip."""
    plain_step = 0.01 + 0.002 * 2
    for _ in range(8):
        gate.observe_round(ObservedRound(2, False, 2, plain_step, target_seconds=plain_step), cm)
    verify = 0.01 + 0.002 * 4
    skipped = False
    for _ in range(8):
        seconds = slow * (verify + 0.004)
        skipped |= gate.observe_round(ObservedRound(2, True, 4, seconds, draft_seconds=slow * 0.004, gamma=1, expected=4.0,
                                                    lengths=torch.tensor([1, 1]), accepted=torch.tensor([1, 1]),
                                                    target_seconds=slow * verify), cm)
    return skipped


def test_a_slower_machine_is_not_read_as_a_loss_of_drafting():
    """The plain rounds ran in a fast minute, the drafted ones in a slow one (1.5×: the 2-core VMs
    drift by ±40 % within a minute). On the wall clock drafting reads 4 / 0.033 against 2 / 0.014:
    a loss, and the gate skips. Each round divided by its own φ (verification seconds / the
    model's t(B) + α(R)) compares the same machine: drafting pays, no skip. Without the
    verification seconds (a caller that does not pass them) the wall clock is all there is."""
    cm = _cost({b: 0.01 + 0.002 * b for b in range(1, 17)})
    assert not _drift_rounds(DraftGate(), cm, slow=1.5)
    assert _drift_rounds(DraftGate(speed_normalised=False), cm, slow=1.5)
    assert not _drift_rounds(DraftGate(), cm, slow=1.0)  # no drift: both clocks agree


def test_speed_factor_and_the_overhead_on_the_cost_models_clock():
    """φ = measured / modelled verification (not clipped: a profile 10× off still gives consistent
    units); the overhead a drafted round measures is its excess over t(B) + α(R) on the model's
    clock, so a machine running 2× slow measures the same 4 ms of drafting that it would at the
    profile's speed (on the wall clock: 2 · (18 + 4) − 18 = 26 ms)."""
    from dspark.gate_forecast import speed_factor

    assert speed_factor(0.030, 0.020) == pytest.approx(1.5)
    assert speed_factor(1.0, 0.010) == pytest.approx(100.0) and speed_factor(0.001, 0.010) == pytest.approx(0.1)
    assert speed_factor(0.0, 0.010) == 1.0 and speed_factor(0.02, 0.0) == 1.0
    cm = _cost({b: 0.01 + 0.002 * b for b in range(1, 17)})
    for normalised, want in ((True, 0.004), (False, 2 * 0.022 - 0.018)):
        g = DraftGate(speed_normalised=normalised, min_evidence=1)
        g.observe_round(ObservedRound(2, True, 4, 2 * 0.022, draft_seconds=0.008, gamma=1, expected=4.0,
                                      lengths=torch.tensor([1, 1]), accepted=torch.tensor([1, 1]), target_seconds=2 * 0.018), cm)
        assert g.forecaster.overhead[2].value == pytest.approx(want)


def test_an_engine_round_reaches_the_gate_and_the_round_record_whole():
    """The engine hands the gate its RoundResult: a drafted round gives τ̂, the drafting seconds, γ,
    ℓ, the accepted drafts, the calibrated prefix survival and the verification seconds; a plain
    round only R, its committed tokens and its seconds. RoundInfo records the same round."""
    from dspark.round import RoundInfo, RoundResult
    from dspark.types import DraftBlock

    block = DraftBlock.dummy(num_requests=2, gamma=3)
    conf = torch.tensor([[0.9, 0.5, 0.5], [0.8, 0.5, 0.1]])  # [R, γ] calibrated
    res = RoundResult(block, block.confidence_logits, torch.tensor([2, 1]), 3.4, torch.tensor([1, 0]),
                      torch.zeros(2, 4, dtype=torch.long), None, 0.004, 0.02, conf)
    r = ObservedRound.from_result(res, 0.03, catch_up=0.001)
    assert (r.num_requests, r.drafted, r.committed, r.seconds) == (2, True, 3, 0.03)
    assert (r.draft_seconds, r.gamma, r.expected, r.catch_up, r.target_seconds) == (0.004, 3, 3.4, 0.001, 0.02)
    assert r.lengths.tolist() == [2, 1] and r.accepted.tolist() == [1, 0]
    torch.testing.assert_close(r.survival, torch.cumprod(conf, dim=1))
    zeros = torch.zeros(2, dtype=torch.long)
    plain = ObservedRound.from_result(RoundResult(None, None, zeros, 2.0, zeros, zeros[:, None], None, 0.0, 0.01), 0.012)
    assert (plain.drafted, plain.committed, plain.draft_seconds, plain.gamma, plain.expected, plain.survival) == \
        (False, 2, None, 0, None, None)
    cm = _cost({b: 0.01 + 0.002 * b for b in range(1, 17)})
    a, b = DraftGate(min_evidence=1), DraftGate(min_evidence=1)
    assert a.observe(res, 0.03, cm, catch_up=0.001) == b.observe_round(r, cm)
    assert a.speculative == b.speculative and a.forecaster.overhead == b.forecaster.overhead
    info = RoundInfo.from_result(res, batch_size=5, seconds=0.03, context=12.5)
    assert info == RoundInfo(2, [2, 1], [1, 0], 5, True, 3.4, 0.004, 0.02, 0.03, 12.5)
