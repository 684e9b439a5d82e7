"""STS + per-position bias: recovers a known shift that temperatures alone cannot remove."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.calibration import (
    CalibratorFormatError,
    STSBiasCalibrator,
    STSCalibrator,
    load_calibrator,
    synthetic_rounds,
)
from dspark.confidence_report import confidence_report

GAMMA = 7
N = 30_000
# z_j = SLOPE · logit(c*_j) + SHIFT: σ(z_j / SLOPE − SHIFT / SLOPE) is exactly calibrated.
SLOPE, SHIFT = 2.0, 1.2


@pytest.fixture(scope="module")
def shifted():
    data = synthetic_rounds(N, GAMMA, slope=SLOPE, bias=SHIFT, generator=torch.Generator().manual_seed(3))
    return data.take(slice(0, N // 2)), data.take(slice(N // 2, None))


@pytest.fixture(scope="module")
def fitted(shifted):
    fit, _ = shifted
    return (
        STSCalibrator(n_bins=20).fit(fit.logits, fit.accepted),
        STSBiasCalibrator().fit(fit.logits, fit.accepted),
    )


def test_sts_bias_recovers_the_known_temperature_and_shift(fitted):
    _, both = fitted
    # Position 1 sees every row: (T_1, b_1) lands near the generator's (2, −0.6).
    assert both.temperatures[0] == pytest.approx(SLOPE, rel=0.15)
    assert both.biases[0] == pytest.approx(-SHIFT / SLOPE, abs=0.15)
    assert all(b < 0 for b in both.biases)  # the shift is over-confidence at every position
    assert both.fit_info.objective == "sequential_survival_ece_bias"
    assert both.n_bins == 20  # the paper's ECE bins


def test_sts_bias_calibrates_held_out_rounds_where_sts_cannot(shifted, fitted):
    _, ev = shifted
    sts, both = fitted
    rep_sts = confidence_report(sts.calibrate(ev.logits), ev.accepted, n_bins=20)
    rep_both = confidence_report(both.calibrate(ev.logits), ev.accepted, n_bins=20)
    assert max(rep_both.ece) <= 0.02, rep_both.to_markdown()
    assert max(abs(b) for b in rep_both.cumprod_bias) <= 0.02
    # a temperature alone cannot remove the shift: STS stays worse on average
    assert sum(rep_both.ece) < 0.7 * sum(rep_sts.ece), (rep_sts.ece, rep_both.ece)


def test_sts_bias_is_never_worse_than_the_raw_head_on_its_fitting_data():
    # already calibrated logits: the fit must keep (about) T = 1, b = 0
    data = synthetic_rounds(8000, 3, slope=1.0, bias=0.0, generator=torch.Generator().manual_seed(5))
    cal = STSBiasCalibrator().fit(data.logits, data.accepted)
    assert all(a <= b + 1e-12 for a, b in zip(cal.fit_info.ece_after, cal.fit_info.ece_before))


def test_sts_bias_blocks_shorter_and_longer(fitted, shifted):
    _, ev = shifted
    _, both = fitted
    short = both.calibrate(ev.logits[:10, :3])
    torch.testing.assert_close(short, both.calibrate(ev.logits[:10])[:, :3])
    with pytest.raises(ValueError, match="fitted for γ=7"):
        both.calibrate(torch.zeros(2, 8))


def test_sts_bias_is_a_registered_calibrator():
    assert type(dspark.get_calibrator("sts-bias")) is STSBiasCalibrator


def test_sts_bias_load_errors_name_the_problem():
    good = {"name": "sts-bias", "gamma": 2, "temperatures": [1.0, 2.0], "biases": [0.0, -0.5]}
    assert load_calibrator(good).biases == (0.0, -0.5)
    with pytest.raises(CalibratorFormatError, match="field 'biases' is missing"):
        load_calibrator({k: v for k, v in good.items() if k != "biases"})
    with pytest.raises(CalibratorFormatError, match="'biases' must be a list of numbers"):
        load_calibrator({**good, "biases": "0"})
    with pytest.raises(CalibratorFormatError, match="biases hold 1 values but temperatures 2"):
        load_calibrator({**good, "biases": [0.0]})
    with pytest.raises(CalibratorFormatError, match="biases must be finite"):
        load_calibrator({**good, "biases": [0.0, float("inf")]})


def test_ece_noise_floor_matches_the_binomial_expectation():
    """One bin (every prediction 0.5): ECE = |0.5 − X/N| with X ~ Bin(N, 1/2), whose mean is a
    finite sum — an oracle independent of the Monte Carlo."""
    import math

    from dspark.metrics import ece_noise_floor

    n = 400
    exact = sum(math.comb(n, x) * 0.5**n * abs(0.5 - x / n) for x in range(n + 1))
    assert ece_noise_floor(torch.full((n,), 0.5), n_bins=20, draws=4000) == pytest.approx(exact, rel=0.05)
    # more rows, a lower floor (≈ 1/√N): 16× the rows, about a quarter of the floor
    big = ece_noise_floor(torch.full((16 * n,), 0.5), n_bins=20, draws=400)
    assert big == pytest.approx(exact / 4, rel=0.1)
    assert math.isnan(ece_noise_floor(torch.empty(0)))


@pytest.mark.parametrize(("ece", "shipped"), [
    ({"identity": 0.0123, "sts": 0.0134, "sts-bias": 0.0140}, "identity"),  # raw best (dspark-2l's case)
    ({"identity": 0.0281, "sts": 0.0275, "sts-bias": 0.0224}, "sts-bias"),  # dspark-5l-long's case
    ({"identity": 0.0300, "sts": 0.0200, "sts-bias": 0.0195}, "sts"),  # the bias gains < 0.1 points
    ({"identity": 0.0205, "sts": 0.0200, "sts-bias": 0.0196}, "identity"),  # within 0.1 points of the lowest
])
def test_dspark_calibrate_ships_the_simplest_calibrator_within_a_tenth_of_a_point(ece, shipped):
    from dspark.evaluation.calibration_run import CALIBRATORS, simplest_within_margin

    assert CALIBRATORS == ("identity", "sts", "sts-bias")
    assert simplest_within_margin(ece, CALIBRATORS) == shipped
    assert simplest_within_margin(ece, ("sts",)) == "sts"  # one asked for: that one
