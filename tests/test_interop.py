"""Interop files for TensorRT-LLM and vLLM: each writer's output passes the consuming engine's
documented checks (reimplemented in dspark.interop.check_*), the additive cost fit recovers a known
model, and the per-batch-size draft lengths follow from the cost model and acceptance."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import dspark
from dspark.calibration import STSCalibrator
from dspark.cost_models import SPSProfile
from dspark.interop import (
    FormatError,
    best_fixed_lengths,
    check_draft_len_schedule,
    check_trtllm_sps_table,
    check_vllm_per_batch_size,
    draft_len_schedule,
    trtllm_sps_table,
    trtllm_sts,
    vllm_per_batch_size,
    write_interop,
)
from dspark.profiling import ProfileFitError, additive_cost_fit

PROFILE = SPSProfile(device="test", model="m", dtype="bfloat16", date="2026-11-30", accounting="padded",
                     points=[(1, 0.010), (8, 0.011), (64, 0.030), (512, 0.200)])


def test_sts_temperatures_in_trtllm_form():
    cal = STSCalibrator(temperatures=(0.8, 1.0, 1.7))
    assert trtllm_sts(cal) == {"sts_temperatures": [0.8, 1.0, 1.7]}
    # the file means the same thing as the calibrator: c_j = σ(z_j / T_j)
    z = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.allclose(cal.calibrate(z), torch.sigmoid(z / torch.tensor(trtllm_sts(cal)["sts_temperatures"])))
    with pytest.raises(FormatError, match="fitted STS"):
        trtllm_sts(dspark.get_calibrator("identity"))


def shapes_of(bias, alpha, theta, Rs, widths):
    return {(R, w): bias + alpha(R) + theta(R * w) for R in Rs for w in widths}


def test_additive_fit_recovers_bias_batch_overhead_and_token_cost():
    alpha = {1: 0.0, 2: 0.4e-3, 4: 1.0e-3, 8: 2.5e-3}.get
    theta = lambda M: 0.05e-3 * M + (0.3e-3 if M > 16 else 0.0)  # noqa: E731  a staircase step at 16
    bias, a, th = additive_cost_fit(shapes_of(2e-3, alpha, theta, [1, 2, 4, 8], [1, 2, 4, 8]))
    assert bias == pytest.approx(2e-3, abs=1e-9)
    assert all(a[R] == pytest.approx(alpha(R), abs=1e-9) for R in (1, 2, 4, 8))
    assert all(th[M] == pytest.approx(theta(M), abs=1e-9) for M in th)
    with pytest.raises(ProfileFitError, match="connect"):
        additive_cost_fit({(1, 1): 0.01, (1, 2): 0.011, (3, 1): 0.02, (3, 2): 0.021})


def test_sps_table_decomposed_and_whole_step():
    shapes = shapes_of(2e-3, lambda R: 1e-4 * R, lambda M: 5e-5 * M, [1, 2, 4], [1, 2, 4])
    t = trtllm_sps_table(PROFILE, shapes, gamma=7)
    assert t["token_counts"] == [1, 2, 4, 8, 16]
    assert t["_meta"]["lookup"] == "interp" and t["_meta"]["recommended_confidence_verify_len_tiers"] == [1, 4, 7]
    assert t["fixed_overhead_ms"] == pytest.approx(2.1)  # bias + α(1), α measured from R = 1
    assert t["batch_sizes"] == [1, 2, 4] and t["batch_overhead_ms"] == pytest.approx([0.0, 0.1, 0.3])
    assert t["step_time_ms"] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8])
    whole = trtllm_sps_table(PROFILE)
    assert whole["token_counts"] == [1, 8, 64, 512] and whole["step_time_ms"] == pytest.approx([10, 11, 30, 200])
    assert "fixed_overhead_ms" not in whole
    for bad, msg in [({"token_counts": [1, 1], "step_time_ms": [1.0, 2.0]}, "strictly increasing"),
                     ({"token_counts": [1, 2], "step_time_ms": [1.0]}, "length"),
                     ({"token_counts": [1], "step_time_ms": [0.0]}, "> 0"),
                     ({"token_counts": [1], "step_time_ms": [1.0], "batch_sizes": [1]}, "together")]:
        with pytest.raises(FormatError, match=msg):
            check_trtllm_sps_table(bad)


def test_decomposed_sps_table_is_the_monotone_fit_of_noisy_shapes():
    """Shapes timed with noise: θ dips at M = 4 (faster than M = 2) and α at R = 4 (below R = 2).
    The written table never charges less for more tokens or more requests — the pooled values of
    the isotonic fit, computed here by hand."""
    theta = {1: 5e-5, 2: 1.0e-4, 4: 0.6e-4, 8: 4e-4, 16: 8e-4}.get
    alpha = {1: 0.0, 2: 0.4e-3, 4: 0.2e-3}.get
    shapes = shapes_of(2e-3, alpha, theta, [1, 2, 4], [1, 2, 4])
    _, a_raw, th_raw = additive_cost_fit(shapes)
    assert th_raw[4] < th_raw[2] and a_raw[4] < a_raw[2]  # the dips are in the raw fit
    t = trtllm_sps_table(PROFILE, shapes, gamma=7)
    steps, over = t["step_time_ms"], t["batch_overhead_ms"]
    assert all(b >= a for a, b in zip(steps, steps[1:])) and all(b >= a for a, b in zip(over, over[1:]))
    pooled = 1e3 * (th_raw[2] + th_raw[4]) / 2  # PAV pools the violating pair to its mean
    assert steps[1] == pytest.approx(pooled) and steps[2] == pytest.approx(pooled)
    assert over[1] == pytest.approx(over[2]) == pytest.approx(1e3 * (a_raw[2] + a_raw[4]) / 2)


def test_best_fixed_lengths_follow_cost_and_acceptance():
    cm = dspark.get_cost_model("sps-table", profile=PROFILE)
    s = [0.8, 0.6, 0.45, 0.3, 0.2, 0.12, 0.07]
    lengths = best_fixed_lengths(s, cm, [1, 2, 4, 8, 16, 32, 64, 128])
    assert lengths[1] == 7  # flat cost at small B: verify everything
    assert lengths[128] == 0  # B = 128 · (1 + k) is deep in the linear part
    ks = [lengths[R] for R in sorted(lengths)]
    assert ks == sorted(ks, reverse=True)
    # a slow drafter switches speculation off at a smaller batch (and, once drafting, amortises
    # its cost over longer drafts, so k itself need not shrink)
    slow = best_fixed_lengths(s, cm, [1, 2, 4, 8, 16, 32, 64, 128], lambda R: 0.02)
    assert min(R for R, k in slow.items() if k == 0) < min(R for R, k in lengths.items() if k == 0)
    # hand check at R = 1: throughput of k is (1 + Σ s_≤k) / t(1 + k)
    rate = lambda k: (1 + sum(s[:k])) / float(cm.step_seconds(torch.tensor([1 + k]))[0])  # noqa: E731
    assert max(range(8), key=rate) == lengths[1]
    with pytest.raises(ValueError, match="non-increasing"):
        best_fixed_lengths([0.5, 0.7], cm, [1])


def test_schedules_in_trtllm_and_vllm_form():
    lengths = {1: 7, 2: 7, 4: 3, 8: 1, 16: 0, 32: 0}
    assert draft_len_schedule(lengths) == {"max_draft_len": 7, "draft_len_schedule": {2: 7, 4: 3, 8: 1}}
    assert vllm_per_batch_size(lengths, 256) == [[1, 2, 7], [3, 4, 3], [5, 8, 1], [9, 256, 0]]
    assert vllm_per_batch_size({1: 2, 64: 1}, 256) == [[1, 1, 2], [2, 64, 1], [65, 256, 0]]
    with pytest.raises(FormatError, match="max_draft_len"):
        check_draft_len_schedule({1: 3, 4: 4}, 4)
    with pytest.raises(FormatError, match="start at batch size 1"):
        check_vllm_per_batch_size([[2, 4, 1]], 4)
    with pytest.raises(FormatError, match="overlaps"):
        check_vllm_per_batch_size([[1, 4, 2], [4, 8, 1]], 4)


def test_write_interop_and_the_cli(tmp_path, capsys):
    notes = write_interop(tmp_path / "a", gamma=7, model="drafter", calibrator=STSCalibrator(temperatures=(1.0,) * 7),
                          profile=PROFILE, survival=[0.8, 0.6, 0.45, 0.3, 0.2, 0.12, 0.07])
    assert all(n.startswith("wrote") for n in notes)
    cfg = yaml.safe_load((tmp_path / "a/trtllm/extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert cfg["decoding_type"] == "DSpark" and cfg["confidence_sts_path"] == "sts.json" and cfg["max_draft_len"] == 7
    sched = yaml.safe_load((tmp_path / "a/trtllm/extra_llm_api_options.draft_len_schedule.yaml").read_text())
    check_draft_len_schedule(sched["speculative_config"]["draft_len_schedule"], sched["speculative_config"]["max_draft_len"])
    v = json.loads((tmp_path / "a/vllm/speculative_config.per_batch_size.json").read_text())
    check_vllm_per_batch_size(v["num_speculative_tokens_per_batch_size"], v["num_speculative_tokens"])
    assert json.loads((tmp_path / "a/vllm/speculative_config.adaptive.json").read_text())["enable_adaptive_verification"]
    # shapes that cannot be split into α(R) + θ(B): the whole-step table, and a note saying so
    disconnected = {(1, 1): 0.01, (1, 2): 0.011, (3, 1): 0.02, (3, 2): 0.021}
    notes = write_interop(tmp_path / "d", gamma=7, model="d", profile=PROFILE, shapes=disconnected)
    assert any("whole-step table written" in n for n in notes)
    assert "fixed_overhead_ms" not in json.loads((tmp_path / "d/trtllm/sps_table.json").read_text())
    # without STS or traces: what can be written is, the rest is named
    notes = write_interop(tmp_path / "b", gamma=7, model="d", profile=PROFILE)
    assert any("sts.json not written" in n for n in notes) and any("draft lengths not written" in n for n in notes)

    from dspark.cli import main
    from dspark.evaluation.rounds import Rounds

    prof = tmp_path / "profile.json"
    PROFILE.to_json(prof)
    rounds = Rounds(("x",) * 4, torch.tensor([7, 3, 0, 1]), torch.full((4,), 7), torch.full((4,), 7),
                    torch.zeros(4, 7), (0, 0, 1, 1), 20, 1.0)
    (tmp_path / "rounds.json").write_text(json.dumps(rounds.to_dict()))
    assert main(["interop", "--out", str(tmp_path / "c"), "--profile", str(prof), "--traces",
                 str(tmp_path / "rounds.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # --json: one object, what was written
    assert report["out"] == str(tmp_path / "c") and any("best_fixed_lengths" in line for line in report["written"])
    got = json.loads((tmp_path / "c/best_fixed_lengths.json").read_text())
    assert got["survival"] == [0.75, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    # --calibration overrides the drafter's own calibration.json: an STS file's temperatures, exactly
    STSCalibrator(temperatures=(1.5, 2.0, 1.0, 1.0, 1.0, 1.0, 3.0)).save(tmp_path / "sts_cal.json")
    assert main(["interop", "--out", str(tmp_path / "d"), "--profile", str(prof), "--traces",
                 str(tmp_path / "rounds.json"), "--calibration", str(tmp_path / "sts_cal.json")]) == 0
    assert json.loads((tmp_path / "d/trtllm/sts.json").read_text())["sts_temperatures"] == [1.5, 2.0, 1.0, 1.0, 1.0, 1.0, 3.0]


LONG = [(1, 0.012), (8, 0.020), (64, 0.120), (512, 0.900)]  # the same target over 1024 tokens of KV


def test_interop_files_are_written_at_the_serving_context(tmp_path):
    """The engines' files have no context axis: a profile with curves at 64 and 1024 tokens is
    written at the context asked for (the curve itself there, linear in between), and the
    fixed lengths are chosen with the cost model read there (costlier tokens: shorter drafts)."""
    prof = SPSProfile(device="test", model="m", dtype="bfloat16", date="2026-11-30", accounting="padded",
                      points=PROFILE.points, context=64, contexts=[(1024, LONG)])
    at_long = trtllm_sps_table(prof, gamma=7, context=1024)
    assert at_long["step_time_ms"] == pytest.approx([12, 20, 120, 900]) and at_long["_meta"]["context_tokens"] == 1024
    mid = trtllm_sps_table(prof, context=544)  # halfway
    assert mid["step_time_ms"] == pytest.approx([11, 15.5, 75, 550])
    assert trtllm_sps_table(prof)["step_time_ms"] == pytest.approx([10, 11, 30, 200])  # default: its own context
    s = [0.8, 0.6, 0.45, 0.3, 0.2, 0.12, 0.07]
    for ctx in (64, 1024):
        write_interop(tmp_path / str(ctx), gamma=7, model="d", profile=prof, survival=s, context=ctx)
    short, long = ({int(k): v for k, v in json.loads((tmp_path / f"{c}/best_fixed_lengths.json").read_text())
                    ["lengths"].items()} for c in (64, 1024))
    cm = dspark.get_cost_model("sps-table", profile=prof)
    assert long == best_fixed_lengths(s, cm.at_context(1024), sorted(long))
    assert all(long[R] <= short[R] for R in short) and long != short
    assert json.loads((tmp_path / "1024/trtllm/sps_table.json").read_text())["_meta"]["context_tokens"] == 1024


def test_profile_from_shapes_splits_request_overhead_from_token_cost(tmp_path):
    """One request verifying 8 tokens and 8 requests verifying one share B = 8 but not their cost:
    the profile keeps bias + θ(B) as points and α(R) as batch_overhead, and reproduces every shape."""
    from dspark.profiling import profile_from_shapes

    alpha = {1: 0.0, 2: 1e-3, 4: 3e-3, 8: 7e-3}
    theta = lambda M: 0.2e-3 * M  # noqa: E731
    times = {(128, R, w): 0.02 + alpha[R] + theta(R * w) for R in alpha for w in (1, 2, 4, 8)}
    prof = profile_from_shapes(times, model="m", dtype="bf16", device="d", repeats=1)
    assert [r for r, _ in prof.batch_overhead] == list(alpha)
    assert [v for _, v in prof.batch_overhead] == pytest.approx(list(alpha.values()), abs=1e-12)
    cm = dspark.get_cost_model("sps-table", profile=prof)
    from dspark.cost_models import round_seconds

    for (_, R, w), t in times.items():
        assert round_seconds(cm, R * w, R) == pytest.approx(t)
    prof.to_json(tmp_path / "p.json")
    assert SPSProfile.from_json(tmp_path / "p.json") == prof
    bad = {**prof.to_dict(), "batch_overhead": [{"num_requests": 2, "seconds": 0.0}, {"num_requests": 1, "seconds": 0.0}]}
    with pytest.raises(dspark.cost_models.ProfileError, match="num_requests must be an integer above 2"):
        SPSProfile.from_json(bad)
    # one request count only: nothing to split, no overhead recorded
    single = profile_from_shapes({(128, 1, w): 0.02 + theta(w) for w in (1, 2, 4)}, model="m", dtype="d",
                                 device="d", repeats=1)
    assert single.batch_overhead == ((1, 0.0),) and len(single.points) == 3


def test_request_overhead_lengthens_the_sps_greedy_schedule():
    """Θ = τ / (t(B) + α(R)): a per-request overhead that every choice pays makes extra verified
    tokens relatively cheaper, so SPS-greedy verifies further (dropping α would over-trim)."""
    base = {"device": "t", "model": "m", "dtype": "f", "date": "d", "accounting": "padded",
            "points": [{"batch_size": 1, "step_seconds": 0.010}, {"batch_size": 5, "step_seconds": 0.014}]}
    c = torch.full((1, 4), 0.6)
    sched = dspark.get_scheduler("sps-greedy")
    plain = sched.schedule(c, torch.tensor([4]), dspark.get_cost_model("sps-table", profile=base))
    heavy = sched.schedule(c, torch.tensor([4]), dspark.get_cost_model(
        "sps-table", profile={**base, "batch_overhead": [{"num_requests": 1, "seconds": 0.05}]}))
    assert plain.lengths.tolist() == [3] and heavy.lengths.tolist() == [4]
    assert heavy.expected_throughput == pytest.approx(heavy.expected_tokens / (0.014 + 0.05))


def test_sts_bias_calibration_is_not_written_as_temperatures_only(tmp_path):
    from dspark.calibration import STSBiasCalibrator

    cal = STSBiasCalibrator(temperatures=(2.0, 2.0), biases=(-0.5, -0.4))
    notes = write_interop(tmp_path, gamma=2, model="d", calibrator=cal)
    # the file would drop the biases and mean σ(z / T) — a different calibration
    assert not (tmp_path / "trtllm" / "sts.json").exists()
    assert any("temperatures only" in n and "--calibrator sts" in n for n in notes), notes
