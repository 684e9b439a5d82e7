"""Calibrators (identity, temperature, STS, STS + bias), confidence metrics and the reliability diagram."""

from __future__ import annotations

import json
import math

import attrs
import numpy as np
import pytest
import torch

from dspark.calibration import (
    CalibratorFormatError,
    IdentityCalibrator,
    STSBiasCalibrator,
    STSCalibrator,
    TemperatureCalibrator,
    load_calibrator,
    synthetic_rounds,
)
from dspark.confidence_report import ConfidenceReport, confidence_report
from dspark.metrics import (
    auroc,
    brier_score,
    conditional_labels,
    expected_calibration_error,
    reliability_bins,
    survival_labels,
    verified_mask,
)
from dspark.protocols import Calibrator

GAMMA = 7
N = 40_000
SLOPE, BIAS = 2.0, 0.2


@pytest.fixture(scope="module")
def rounds():
    """Over-confident synthetic rounds, split into disjoint fitting and evaluation halves."""
    data = synthetic_rounds(
        N, GAMMA, slope=SLOPE, bias=BIAS, generator=torch.Generator().manual_seed(0)
    )
    return data.take(slice(0, N // 2)), data.take(slice(N // 2, None))


@pytest.fixture(scope="module")
def sts(rounds):
    fit, _ = rounds
    return STSCalibrator().fit(fit.logits, fit.accepted)


# --------------------------------------------------------------------------------------------
# STS on data with known miscalibration
# --------------------------------------------------------------------------------------------


def test_raw_confidence_is_miscalibrated(rounds):
    _, ev = rounds
    report = confidence_report(IdentityCalibrator().calibrate(ev.logits), ev.accepted)
    assert report.ece[0] > 0.03
    assert min(report.ece[2:]) > 0.08  # the product compounds the per-step bias
    assert all(b > 0.05 for b in report.cumprod_bias[1:])  # over-confident


def test_sts_calibrates_every_position_on_held_out_data(rounds, sts):
    _, ev = rounds
    report = confidence_report(sts.calibrate(ev.logits), ev.accepted)
    assert max(report.ece) <= 0.02, report.to_markdown()
    assert max(abs(b) for b in report.cumprod_bias) <= 0.02
    # Temperature scaling is monotone per position: ranking at j=1 is unchanged (up to float32
    # rounding creating or splitting ties).
    raw = confidence_report(torch.sigmoid(ev.logits), ev.accepted)
    assert report.auroc[0] == pytest.approx(raw.auroc[0], abs=1e-5)
    # Over-confident slope 2 → every T_j near 2.
    assert all(1.5 < t < 3.0 for t in sts.temperatures)
    assert sts.gamma == GAMMA and sts.fit_info is not None
    assert all(a < b for a, b in zip(sts.fit_info.ece_after, sts.fit_info.ece_before))


def test_sts_beats_single_temperature_on_fitting_data(rounds, sts):
    fit, _ = rounds
    temp = TemperatureCalibrator().fit(fit.logits, fit.accepted)
    # STS minimises each position's survival ECE given the earlier T, so it matches or beats one
    # shared T at position 1 exactly and, in practice, at the rest.
    assert sts.fit_info.ece_after[0] <= temp.fit_info.ece_after[0] + 1e-12
    assert sum(sts.fit_info.ece_after) <= sum(temp.fit_info.ece_after)


def test_fit_returns_new_instance_and_leaves_self_unfitted(rounds):
    fit, _ = rounds
    blank = STSCalibrator()
    fitted = blank.fit(fit.logits[:2000], fit.accepted[:2000])
    assert blank.temperatures == () and blank.fit_info is None
    assert fitted is not blank and fitted.gamma == GAMMA
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fitted.temperatures = (1.0,)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="not fitted"):
        blank.calibrate(fit.logits)


def test_all_builtins_satisfy_the_protocol(rounds):
    fit, _ = rounds
    for cls in (IdentityCalibrator, TemperatureCalibrator, STSCalibrator, STSBiasCalibrator):
        cal = cls().fit(fit.logits[:3000], fit.accepted[:3000])
        assert isinstance(cal, Calibrator)
        assert isinstance(cls.name, str)
        c = cal.calibrate(fit.logits[:5])
        assert c.shape == (5, GAMMA) and c.dtype == fit.logits.dtype


# --------------------------------------------------------------------------------------------
# Identity and single temperature
# --------------------------------------------------------------------------------------------


def test_identity_is_sigmoid():
    z = torch.tensor([[-3.0, 0.0, 2.5], [10.0, -10.0, 0.1]])
    cal = IdentityCalibrator()
    assert torch.equal(cal.calibrate(z), torch.sigmoid(z))
    fitted = cal.fit(z, torch.tensor([1, 3]))
    assert torch.equal(fitted.calibrate(z), torch.sigmoid(z))
    assert fitted.fit_info.ece_before == fitted.fit_info.ece_after
    # Any block length works.
    assert fitted.calibrate(torch.zeros(2, 9)).shape == (2, 9)


def test_temperature_recovers_the_slope_without_bias():
    data = synthetic_rounds(
        20_000, 6, slope=3.0, bias=0.0, generator=torch.Generator().manual_seed(1)
    )
    cal = TemperatureCalibrator().fit(data.logits, data.accepted)
    assert cal.temperature == pytest.approx(3.0, rel=0.05)
    z = torch.tensor([[3.0, -1.5]])
    assert torch.allclose(cal.calibrate(z), torch.sigmoid(z / cal.temperature))


@pytest.mark.parametrize("slope, bias", [(3.0, 0.0), (2.0, 0.2), (0.7, -0.5)])
def test_temperature_matches_a_golden_section_search(slope, bias):
    """The fitted T (scipy's bounded Brent) is the BCE minimiser the former hand-written
    golden-section search in log T found, to 1e-4."""
    data = synthetic_rounds(
        20_000, 6, slope=slope, bias=bias, generator=torch.Generator().manual_seed(1)
    )
    z = data.logits.double()
    labels, at_risk = conditional_labels(data.accepted, 6)
    zs, ys = z[at_risk], labels[at_risk].double()

    def nll(log_t: float) -> float:
        return float(torch.nn.functional.binary_cross_entropy_with_logits(zs / math.exp(log_t), ys))

    inv_phi = (math.sqrt(5) - 1) / 2
    a, b = math.log(0.01), math.log(100.0)
    for _ in range(80):
        c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
        a, b = (a, d) if nll(c) <= nll(d) else (c, b)
    expected = math.exp((a + b) / 2)
    assert TemperatureCalibrator().fit(data.logits, data.accepted).temperature == pytest.approx(
        expected, rel=1e-4
    )


def test_temperature_generalises_to_longer_blocks(rounds):
    fit, _ = rounds
    cal = TemperatureCalibrator().fit(fit.logits[:, :3], fit.accepted.clamp(max=3))
    assert cal.calibrate(torch.zeros(2, GAMMA)).shape == (2, GAMMA)


# --------------------------------------------------------------------------------------------
# Block length, persistence
# --------------------------------------------------------------------------------------------


def test_sts_shorter_block_uses_leading_temperatures_and_longer_block_fails():
    cal = STSCalibrator(temperatures=(1.0, 2.0, 4.0))
    z = torch.tensor([[2.0, 2.0], [-4.0, 8.0]])
    expected = torch.sigmoid(z / torch.tensor([1.0, 2.0]))
    assert torch.allclose(cal.calibrate(z), expected)
    with pytest.raises(ValueError, match=r"γ'=4 .* fitted for γ=3"):
        cal.calibrate(torch.zeros(1, 4))


@pytest.mark.parametrize(
    "cls", [IdentityCalibrator, TemperatureCalibrator, STSCalibrator, STSBiasCalibrator]
)
def test_save_load_round_trip(tmp_path, rounds, cls):
    fit, ev = rounds
    cal = cls().fit(fit.logits[:4000], fit.accepted[:4000])
    path = tmp_path / "sub" / f"{cls.name}.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data["name"] == cls.name and data["format"] == "dspark.calibrator"
    assert data["fit"]["n_samples"] == 4000 and len(data["fit"]["ece_after"]) == GAMMA
    for loaded in (load_calibrator(path), load_calibrator(str(path)), load_calibrator(data)):
        assert type(loaded) is cls
        assert loaded == cal
        assert loaded.to_dict() == cal.to_dict()
        assert torch.equal(loaded.calibrate(ev.logits[:50]), cal.calibrate(ev.logits[:50]))


def test_load_errors_name_the_problem(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"name": "sts", "temperatures": [1.0,')
    with pytest.raises(CalibratorFormatError, match="corrupt.json.*not a valid calibrator JSON"):
        load_calibrator(corrupt)
    with pytest.raises(CalibratorFormatError, match="unknown calibrator name 'platt'"):
        load_calibrator({"name": "platt"})
    with pytest.raises(CalibratorFormatError, match="field 'name' is missing"):
        load_calibrator({"temperatures": [1.0]})
    with pytest.raises(CalibratorFormatError, match="field 'temperatures' is missing"):
        load_calibrator({"name": "sts", "gamma": 2})
    with pytest.raises(CalibratorFormatError, match="'gamma' is 3 but 'temperatures' holds 2"):
        load_calibrator({"name": "sts", "gamma": 3, "temperatures": [1.0, 2.0]})
    with pytest.raises(CalibratorFormatError, match="exactly one value"):
        load_calibrator({"name": "temperature", "temperatures": [1.0, 2.0]})
    with pytest.raises(CalibratorFormatError, match="finite and > 0"):
        load_calibrator({"name": "sts", "gamma": 1, "temperatures": [-1.0]})
    not_object = tmp_path / "list.json"
    not_object.write_text("[1]")
    with pytest.raises(CalibratorFormatError, match="list.json: expected a JSON object"):
        load_calibrator(not_object)
    with pytest.raises(TypeError, match="path or a dict"):
        load_calibrator([1, 2])  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        load_calibrator(tmp_path / "missing.json")


# --------------------------------------------------------------------------------------------
# Censoring
# --------------------------------------------------------------------------------------------


def test_survival_and_conditional_labels_by_hand():
    accepted = torch.tensor([0, 2, 1, 1, 3])
    verified = torch.tensor([3, 2, 1, 3, 3])
    labels, known = survival_labels(accepted, 3, verified)
    assert labels.tolist() == [
        [False, False, False],
        [True, True, False],
        [True, False, False],
        [True, False, False],
        [True, True, True],
    ]
    # Rows that survived every verified position (accepted == verified < γ) are censored beyond.
    assert known.tolist() == [
        [True, True, True],
        [True, True, False],
        [True, False, False],
        [True, True, True],
        [True, True, True],
    ]
    assert verified_mask(accepted, 3, verified).tolist() == [
        [True, True, True],
        [True, True, False],
        [True, False, False],
        [True, True, True],
        [True, True, True],
    ]
    y, at_risk = conditional_labels(accepted, 3, verified)
    assert torch.equal(y, labels)
    assert at_risk.tolist() == [
        [True, False, False],
        [True, True, False],
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    no_censoring = survival_labels(accepted, 3)[1]
    assert no_censoring.all()


def test_censored_fit_stays_calibrated_and_known_mask_would_bias(rounds):
    fit, ev = rounds
    g = torch.Generator().manual_seed(5)
    verified = torch.randint(1, GAMMA + 1, (fit.accepted.numel(),), generator=g)  # [N]
    accepted = torch.minimum(fit.accepted, verified)
    cal = STSCalibrator().fit(fit.logits, accepted, verified)
    assert cal.fit_info.n_labelled[0] == fit.accepted.numel()
    assert cal.fit_info.n_labelled[-1] < fit.accepted.numel() / 4
    report = confidence_report(cal.calibrate(ev.logits), ev.accepted)
    assert max(report.ece) <= 0.025, report.to_markdown()

    # Why the scoring mask is "position verified" and not "label known": the known zeros of
    # short-verified rows without their censored survivors make survival look far lower.
    labels, known = survival_labels(accepted, GAMMA, verified)
    true_survival = (fit.accepted >= GAMMA).double().mean()
    naive = labels[known[:, -1], -1].double().mean()
    seen = verified_mask(accepted, GAMMA, verified)[:, -1]
    unbiased = labels[seen, -1].double().mean()
    assert abs(unbiased - true_survival) < 0.02
    assert naive < 0.6 * true_survival

    # The report under censoring uses the same masks.
    rep = confidence_report(cal.calibrate(fit.logits), accepted, verified)
    assert rep.count == cal.fit_info.n_labelled


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    z = torch.zeros(4, 3)
    acc = torch.tensor([0, 1, 2, 3])
    for cal in (IdentityCalibrator(), TemperatureCalibrator(), STSCalibrator()):
        with pytest.raises(ValueError, match="accepted has 3 rows but confidence_logits has 4"):
            cal.fit(z, acc[:3])
        with pytest.raises(ValueError, match=r"accepted must lie in \[0, γ=3\]"):
            cal.fit(z, torch.tensor([0, 1, 2, 4]))
        with pytest.raises(ValueError, match=r"accepted must lie in \[0, γ=3\]"):
            cal.fit(z, torch.tensor([0, -1, 2, 3]))
        with pytest.raises(ValueError, match="1 non-finite"):
            cal.fit(torch.tensor([[0.0, math.nan, 0.0]] + [[0.0] * 3] * 3), acc)
        with pytest.raises(ValueError, match="empty data"):
            cal.fit(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
        with pytest.raises(ValueError, match="must be 2-D"):
            cal.fit(torch.zeros(4), acc)
        with pytest.raises(ValueError, match="accepted must be <= verified"):
            cal.fit(z, acc, verified=torch.tensor([3, 3, 1, 3]))
        with pytest.raises(ValueError, match=r"verified must lie in \[0, γ=3\]"):
            cal.fit(z, acc, verified=torch.tensor([3, 3, 3, 4]))
        with pytest.raises(ValueError, match="whole numbers"):
            cal.fit(z, torch.tensor([0.5, 1.0, 2.0, 3.0]))
        with pytest.raises(ValueError, match="non-finite"):
            cal.calibrate(torch.tensor([[math.inf, 0.0]]))
    with pytest.raises(ValueError, match="finite and > 0"):
        STSCalibrator(temperatures=(1.0, 0.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        TemperatureCalibrator(temperature=math.nan)


def test_numpy_inputs_are_accepted(rounds):
    fit, _ = rounds
    z_np, acc_np = fit.logits[:3000].numpy(), fit.accepted[:3000].numpy()
    a = STSCalibrator().fit(z_np, acc_np)
    b = STSCalibrator().fit(fit.logits[:3000], fit.accepted[:3000])
    assert a.temperatures == pytest.approx(b.temperatures)
    out = a.calibrate(z_np)
    assert isinstance(out, torch.Tensor) and out.shape == z_np.shape


# --------------------------------------------------------------------------------------------
# Metrics against hand-computed values
# --------------------------------------------------------------------------------------------


def test_ece_by_hand():
    pred = [0.1, 0.2, 0.8, 0.9]
    label = [0, 0, 1, 1]
    # Two bins: |0.15 − 0| · ½ + |0.85 − 1| · ½.
    assert expected_calibration_error(pred, label, n_bins=2) == pytest.approx(0.15)
    # One bin: |mean pred − mean label| = |0.5 − 0.5|.
    assert expected_calibration_error(pred, label, n_bins=1) == pytest.approx(0.0)
    # 1.0 lands in the last bin; 0.25 / 0.75 land on bin edges [k/n, (k+1)/n).
    assert expected_calibration_error([1.0, 0.25], [1, 0], n_bins=4) == pytest.approx(0.125)
    assert math.isnan(expected_calibration_error([], []))
    with pytest.raises(ValueError, match=r"pred must lie in \[0, 1\]"):
        expected_calibration_error([1.2], [1])


def test_auroc_known_values_and_ties():
    # scikit-learn's roc_auc_score docstring example.
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.1, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx(0.875)  # one tie = ½
    assert auroc([0.5] * 4, [0, 1, 0, 1]) == pytest.approx(0.5)
    assert auroc([0.9, 0.1], [0, 1]) == pytest.approx(0.0)
    assert math.isnan(auroc([0.2, 0.3], [1, 1]))


def test_auroc_matches_pairwise_definition_with_many_ties():
    rng = np.random.default_rng(3)
    pred = rng.integers(0, 6, 300) / 5.0
    label = rng.integers(0, 2, 300)
    pos, neg = pred[label == 1], pred[label == 0]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0) + 0.5 * (diff == 0)).mean()
    assert auroc(torch.from_numpy(pred), torch.from_numpy(label)) == pytest.approx(expected)


def test_brier_by_hand():
    assert brier_score([0.1, 0.8], [0, 1]) == pytest.approx((0.01 + 0.04) / 2)
    assert brier_score([1.0, 0.0], [1, 0]) == 0.0


def test_reliability_bins_by_hand():
    mean_p, mean_y, count = reliability_bins([0.1, 0.3, 0.9], [0, 1, 1], n_bins=2)
    assert count.tolist() == [2, 1]
    assert mean_p == pytest.approx([0.2, 0.9]) and mean_y == pytest.approx([0.5, 1.0])


def test_confidence_report_by_hand():
    c = torch.tensor([[0.5, 0.5], [1.0, 0.5], [0.5, 1.0], [1.0, 1.0]])  # a = cumprod
    accepted = torch.tensor([0, 1, 1, 2])
    rep = confidence_report(c, accepted, n_bins=1)
    assert isinstance(rep, ConfidenceReport) and rep.gamma == 2
    assert rep.count == (4, 4)
    assert rep.mean_predicted == pytest.approx((0.75, 0.5625))  # a_2 = .25, .5, .5, 1
    assert rep.observed == pytest.approx((0.75, 0.25))
    assert rep.prefix_survival == rep.observed
    assert rep.cumprod_bias == pytest.approx((0.0, 0.3125))
    # Conditional at j=2: rows with accepted ≥ 1 → 1 of 3 accepted position 2.
    assert rep.count_conditional == (4, 3)
    assert rep.conditional_acceptance == pytest.approx((0.75, 1 / 3))
    assert rep.mean_predicted_conditional == pytest.approx((0.75, (0.5 + 1.0 + 1.0) / 3))
    assert rep.brier[1] == pytest.approx((0.25**2 + 0.5**2 + 0.5**2 + 0) / 4)
    d = rep.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["gamma"] == 2 and d["cumprod_bias"] == pytest.approx([0.0, 0.3125])
    md = rep.to_markdown(title="raw")
    assert "| j |" in md and "cumprod bias" in md and md.count("\n| ") >= 3


def test_confidence_report_nan_positions_serialise():
    # Nobody verified position 2: gaps, not crashes, and JSON null instead of NaN.
    rep = confidence_report(
        torch.full((3, 2), 0.5), torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1])
    )
    assert rep.count == (3, 0) and math.isnan(rep.ece[1])
    assert rep.to_dict()["ece"][1] is None
    assert "–" in rep.to_markdown()


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def test_reliability_diagram_writes_png(tmp_path, rounds, sts):
    pytest.importorskip("matplotlib", reason="matplotlib missing: install dspark[plot]")
    from dspark.plotting import reliability_diagram

    _, ev = rounds
    labels, _ = survival_labels(ev.accepted, GAMMA)
    raw = torch.cumprod(torch.sigmoid(ev.logits), dim=1)
    cal = torch.cumprod(sts.calibrate(ev.logits), dim=1)
    out = reliability_diagram(
        {"raw": (raw, labels), "sts": (cal, labels)}, tmp_path / "r.png", positions=[1, 4, 7]
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="positions"):
        reliability_diagram({"raw": (raw, labels)}, tmp_path / "x.png", positions=[8])


def test_importing_dspark_metrics_does_not_import_matplotlib():
    import subprocess
    import sys

    code = "import dspark.calibration, dspark.plotting, sys; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sts_position_without_verified_rows_reuses_previous_temperature(rounds):
    fit, _ = rounds
    verified = torch.ones_like(fit.accepted)  # only position 1 was ever verified
    with pytest.warns(UserWarning, match=r"no verified rows at positions \[2, 3, 4, 5, 6, 7\]"):
        cal = STSCalibrator().fit(fit.logits, fit.accepted.clamp(max=1), verified)
    assert len(set(cal.temperatures)) == 1
    assert cal.fit_info.n_labelled[1:] == (0,) * (GAMMA - 1)
    assert cal.to_dict()["fit"]["ece_after"][1] is None
