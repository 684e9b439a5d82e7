"""Cost models: SPS tables (interpolation, staircase, extrapolation), accounting, profiles, roofline."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspark
from dspark.cost_models import (
    GPU_PRESETS,
    TARGET_SHAPES,
    GPUSpec,
    ProfileError,
    RooflineCostModel,
    SPSProfile,
    SPSTableCostModel,
    default_profile_path,
    kv_bytes_per_token,
    kv_bytes_per_token_from_config,
    table_step_seconds,
)
from dspark.protocols import CostModel
from helpers import tiny_causal_lm

POINTS = {1: 0.050, 4: 0.050, 8: 0.090, 16: 0.170}


def _table(**options) -> SPSTableCostModel:
    return SPSTableCostModel.from_points(POINTS, **options)


def _valid_profile() -> dict:
    return {
        "device": "cpu",
        "model": "tiny",
        "dtype": "float32",
        "date": "2026-11-29",
        "accounting": "packed",
        "points": [
            {"batch_size": 1, "step_seconds": 0.05},
            {"batch_size": 8, "step_seconds": 0.09},
        ],
    }


def _b(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# SPS table: interpolation and extrapolation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpolation", ["linear", "step"])
def test_exact_at_measured_points(interpolation):
    model = _table(interpolation=interpolation)
    sizes = torch.tensor(list(POINTS))  # int64 in → float64 out
    out = model.step_seconds(sizes)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _b(*POINTS.values()))
    torch.testing.assert_close(model.sps(sizes), 1.0 / _b(*POINTS.values()))


def test_linear_between_points():
    model = _table()
    out = model.step_seconds(_b(2, 6, 12, 10))
    torch.testing.assert_close(out, _b(0.050, 0.070, 0.130, 0.110))


def test_step_is_a_staircase_up_to_the_next_bucket():
    model = _table(interpolation="step")
    out = model.step_seconds(_b(2, 5, 7.5, 9, 15, 16))
    torch.testing.assert_close(out, _b(0.050, 0.090, 0.090, 0.170, 0.170, 0.170))


@pytest.mark.parametrize("interpolation", ["linear", "step"])
def test_below_first_point_holds_first_time(interpolation):
    model = SPSTableCostModel.from_points({4: 0.05, 8: 0.09}, interpolation=interpolation)
    torch.testing.assert_close(model.step_seconds(_b(0, 1, 3)), _b(0.05, 0.05, 0.05))


def test_extrapolate_linear_continues_last_slope():
    model = _table(extrapolate="linear")
    # last segment: 8 → 16 adds 0.08 s, i.e. 0.01 s per token
    torch.testing.assert_close(model.step_seconds(_b(20, 32)), _b(0.210, 0.330))


def test_extrapolate_linear_never_below_last_time():
    model = SPSTableCostModel.from_points({1: 0.05, 8: 0.09, 16: 0.08}, fit="none")
    torch.testing.assert_close(model.step_seconds(_b(32, 1000)), _b(0.08, 0.08))


def test_a_falling_table_is_read_as_its_monotone_fit_by_default():
    """B = 16 timed faster than B = 8 is noise: the default fit pools the two to their mean (the
    least-squares non-decreasing curve); fit="none" reads the points as measured."""
    model = SPSTableCostModel.from_points({1: 0.05, 8: 0.09, 16: 0.08})
    torch.testing.assert_close(model.step_seconds(_b(1, 8, 12, 16, 32)), _b(0.05, 0.085, 0.085, 0.085, 0.085))
    raw = SPSTableCostModel.from_points({1: 0.05, 8: 0.09, 16: 0.08}, fit="none")
    torch.testing.assert_close(raw.step_seconds(_b(8, 12)), _b(0.09, 0.085))


def test_extrapolate_linear_with_one_point_is_flat():
    model = SPSTableCostModel.from_points({4: 0.05})
    torch.testing.assert_close(model.step_seconds(_b(1, 4, 100)), _b(0.05, 0.05, 0.05))


def test_extrapolate_clamp():
    model = _table(extrapolate="clamp")
    torch.testing.assert_close(model.step_seconds(_b(17, 1000)), _b(0.170, 0.170))


def test_extrapolate_error_names_b_and_largest_size():
    model = _table(extrapolate="error")
    torch.testing.assert_close(model.step_seconds(_b(16)), _b(0.170))
    with pytest.raises(ValueError, match=r"batch size 40 .*largest profiled batch size 16"):
        model.step_seconds(_b(4, 40))



def test_extrapolate_error_schedules_inside_the_profile():
    """sps-greedy with a no-extrapolation profile works whenever every B it needs is profiled."""
    import dspark

    model = _table(extrapolate="error")  # profiled up to B = 16
    sched = dspark.get_scheduler("sps-greedy")
    plan = sched.schedule(torch.full((2, 7), 0.9), torch.tensor([7, 7]), model)  # B ≤ 2 · 8 = 16
    assert plan.lengths.shape == (2,) and int(plan.lengths.max()) >= 1
    with pytest.raises(ValueError, match="largest profiled batch size 16"):
        sched.schedule(torch.full((4, 7), 0.9), torch.tensor([7, 7, 7, 7]), model)  # B up to 32


def test_vectorised_over_any_shape_and_scalar():
    model = _table()
    grid = torch.arange(1, 33).reshape(4, 8)
    assert model.step_seconds(grid).shape == (4, 8)
    assert model.step_seconds(torch.tensor(6)).item() == pytest.approx(0.070)


def test_rejects_nan_and_negative_batch():
    with pytest.raises(ValueError, match="finite and >= 0"):
        _table().step_seconds(_b(float("nan")))
    with pytest.raises(ValueError, match="finite and >= 0"):
        _table().step_seconds(_b(-1))


def test_bad_options_rejected():
    with pytest.raises(ValueError, match="interpolation"):
        _table(interpolation="cubic")
    with pytest.raises(ValueError, match="extrapolate"):
        _table(extrapolate="zero")
    with pytest.raises(ValueError, match="accounting"):
        SPSTableCostModel(SPSProfile.from_json(_valid_profile()), accounting="ragged")


def test_accounting_defaults_to_profile_and_can_be_overridden():
    profile = SPSProfile.from_json({**_valid_profile(), "accounting": "padded"})
    assert SPSTableCostModel(profile).accounting == "padded"
    assert SPSTableCostModel(profile, accounting="packed").accounting == "packed"


def test_built_from_config_dict_or_path(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_valid_profile()))
    for model in (
        SPSTableCostModel(profile=str(path), interpolation="step"),
        SPSTableCostModel(profile=_valid_profile()),
        SPSTableCostModel.from_file(path),
    ):
        assert model.step_seconds(_b(8)).item() == pytest.approx(0.09)


# --------------------------------------------------------------------------------------------
# Accounting: packed vs padded
# --------------------------------------------------------------------------------------------


def test_packed_and_padded_batch_size():
    lengths = torch.tensor([0, 3, 1])
    assert _table(accounting="packed").batch_size(lengths) == 3 + 4
    assert _table(accounting="padded").batch_size(lengths) == 3 * (1 + 3)
    empty = torch.zeros(0, dtype=torch.long)
    assert _table(accounting="packed").batch_size(empty) == 0
    assert _table(accounting="padded").batch_size(empty) == 0


def test_admission_batch_sizes_examples():
    positions = torch.tensor([1, 1, 2, 1, 3])
    packed = _table(accounting="packed").admission_batch_sizes(3, positions)
    padded = _table(accounting="padded").admission_batch_sizes(3, positions)
    assert packed.tolist() == [3, 4, 5, 6, 7, 8]
    assert padded.tolist() == [3, 6, 6, 9, 9, 12]
    for model in (_table(accounting="packed"), _table(accounting="padded")):
        assert model.admission_batch_sizes(2, torch.zeros(0, dtype=torch.long)).tolist() == [2]


def test_accounting_input_validation():
    model = _table()
    with pytest.raises(TypeError, match="integer"):
        model.batch_size(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        model.batch_size(torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="positions must be >= 1"):
        model.admission_batch_sizes(2, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_requests"):
        model.admission_batch_sizes(-1, torch.tensor([1]))


@st.composite
def _admission_orders(draw):
    """R requests, prefix counts n_r ≤ γ, and an interleaving that keeps each prefix in order."""
    num_requests = draw(st.integers(1, 6))
    gamma = draw(st.integers(1, 7))
    counts = draw(st.lists(st.integers(0, gamma), min_size=num_requests, max_size=num_requests))
    order = draw(st.permutations([r for r, n in enumerate(counts) for _ in range(n)]))
    return num_requests, order


@pytest.mark.parametrize("accounting", ["packed", "padded"])
@settings(max_examples=60, deadline=None)
@given(case=_admission_orders())
def test_admission_sizes_match_batch_size_and_never_decrease(accounting, case):
    num_requests, order = case
    model = _table(accounting=accounting)
    lengths = torch.zeros(num_requests, dtype=torch.long)
    positions, expected = [], [model.batch_size(lengths)]
    for r in order:
        lengths[r] += 1
        positions.append(int(lengths[r]))
        expected.append(model.batch_size(lengths))
    sizes = model.admission_batch_sizes(num_requests, torch.tensor(positions, dtype=torch.long))
    assert sizes.tolist() == expected
    assert bool((sizes[1:] >= sizes[:-1]).all())


# --------------------------------------------------------------------------------------------
# Profiles: JSON and validation
# --------------------------------------------------------------------------------------------


def test_json_round_trip(tmp_path):
    profile = SPSProfile.from_json({**_valid_profile(), "threads": 2, "notes": "hello"})
    path = tmp_path / "profile.json"
    profile.to_json(path)
    assert SPSProfile.from_json(path) == profile
    assert json.loads(path.read_text())["points"][1] == {"batch_size": 8, "step_seconds": 0.09}


def test_steps_per_second_input():
    data = _valid_profile()
    data["points"] = [
        {"batch_size": 1, "steps_per_second": 20.0},
        {"batch_size": 2, "step_seconds": 0.1},
    ]
    profile = SPSProfile.from_json(data)
    assert profile.step_seconds == (0.05, 0.1)
    assert profile.batch_sizes == (1, 2)


def test_from_points_accepts_pairs_and_sorts_mappings():
    pairs = SPSTableCostModel.from_points([(1, 0.05), (8, 0.09)], accounting="padded", device="x")
    assert pairs.profile.device == "x" and pairs.accounting == "padded"
    assert SPSTableCostModel.from_points({8: 0.09, 1: 0.05}).profile.batch_sizes == (1, 8)


def _with_points(*points):
    return {**_valid_profile(), "points": list(points)}


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({k: v for k, v in _valid_profile().items() if k != "device"}, r"missing .*'device'"),
        ({k: v for k, v in _valid_profile().items() if k != "model"}, r"missing .*'model'"),
        ({k: v for k, v in _valid_profile().items() if k != "dtype"}, r"missing .*'dtype'"),
        ({k: v for k, v in _valid_profile().items() if k != "date"}, r"missing .*'date'"),
        ({k: v for k, v in _valid_profile().items() if k != "points"}, r"missing .*'points'"),
        ({**_valid_profile(), "device": ""}, r"device must be a non-empty string"),
        ({**_valid_profile(), "accounting": "ragged"}, r"accounting must be 'packed' or 'padded'"),
        ({**_valid_profile(), "acounting": "packed"}, r"unknown field.*acounting"),
        ({**_valid_profile(), "threads": 0}, r"threads"),
        (_with_points(), r"points must hold at least one"),
        ({**_valid_profile(), "points": 5}, r"points must be"),
        (_with_points({"batch_size": 1, "step_seconds": 0.0}), r"points\[0\]\.step_seconds .*> 0"),
        (_with_points({"batch_size": 1, "step_seconds": -1}), r"points\[0\]\.step_seconds"),
        (_with_points({"batch_size": 1, "step_seconds": math.inf}), r"points\[0\]\.step_seconds"),
        (_with_points({"batch_size": 1, "step_seconds": math.nan}), r"points\[0\]\.step_seconds"),
        (_with_points({"batch_size": 1, "step_seconds": "fast"}), r"points\[0\]\.step_seconds"),
        (_with_points({"batch_size": 1, "steps_per_second": 0}), r"points\[0\]\.steps_per_second"),
        (
            _with_points(
                {"batch_size": 1, "step_seconds": 0.1}, {"batch_size": 1, "step_seconds": 0.2}
            ),
            r"points\[1\]\.batch_size 1 is a duplicate",
        ),
        (
            _with_points(
                {"batch_size": 8, "step_seconds": 0.1}, {"batch_size": 4, "step_seconds": 0.2}
            ),
            r"points\[1\]\.batch_size .*sorted",
        ),
        (_with_points({"batch_size": 0, "step_seconds": 0.1}), r"points\[0\]\.batch_size .*>= 1"),
        (
            _with_points({"batch_size": 2.5, "step_seconds": 0.1}),
            r"points\[0\]\.batch_size .*integer",
        ),
        (_with_points({"batch_size": True, "step_seconds": 0.1}), r"points\[0\]\.batch_size"),
        (_with_points({"step_seconds": 0.1}), r"points\[0\]\.batch_size is missing"),
        (
            _with_points({"batch_size": 1, "step_seconds": 0.1, "steps_per_second": 10}),
            r"points\[0\] .*exactly one of step_seconds / steps_per_second, got both",
        ),
        (_with_points({"batch_size": 1}), r"points\[0\] .*got neither"),
        (_with_points([1, 0.1, 3]), r"points\[0\] must be a \(batch_size, step_seconds\) pair"),
    ],
)
def test_bad_profile_raises_profile_error_naming_the_field(data, pattern):
    with pytest.raises(ProfileError, match=pattern) as info:
        SPSProfile.from_json(data)
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unreadable_and_corrupt_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match=r"nope\.json: cannot read"):
        SPSProfile.from_json(missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"device": ')
    with pytest.raises(ProfileError, match=r"corrupt\.json: not valid JSON"):
        SPSProfile.from_json(corrupt)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileError, match=r"binary\.json: not valid JSON"):
        SPSProfile.from_json(binary)
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    with pytest.raises(ProfileError, match=r"array\.json: must be a JSON object"):
        SPSProfile.from_json(array)
    bad_field = tmp_path / "bad.json"
    bad_field.write_text(json.dumps({**_valid_profile(), "accounting": "x"}))
    with pytest.raises(ProfileError, match=r"bad\.json: accounting"):
        SPSTableCostModel.from_file(bad_field)


def test_from_json_rejects_other_sources():
    with pytest.raises(TypeError, match="path or a dict"):
        SPSProfile.from_json(42)


def test_direct_construction_is_validated():
    with pytest.raises(ProfileError, match="points"):
        SPSProfile("cpu", "m", "fp32", "2026-11-29", "packed", points=[(4, 0.1), (2, 0.2)])


def test_shipped_cpu_profile():
    profile = SPSProfile.from_json(default_profile_path())
    assert profile.model == "SmolLM2-135M-Instruct" and profile.dtype == "float32"
    assert profile.accounting == "padded" and profile.date == "2026-11-29"
    assert dict(profile.points) == {
        1: 0.054,
        2: 0.085,
        4: 0.085,
        8: 0.085,
        16: 0.108,
        32: 0.166,
        64: 0.208,
        128: 0.609,
    }
    assert "0.085" in profile.notes
    model = SPSTableCostModel(profile)
    # The knee of §6: past 64 requests each verified token costs far more.
    assert model.sps(_b(128)).item() < 0.5 * model.sps(_b(64)).item()


# --------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------


def _roofline(**options) -> RooflineCostModel:
    # 1e9 params × 2 bytes at 1e12 B/s → 2 ms of weights; 2e9 FLOP/token at 1e14 FLOP/s → 20 µs.
    return RooflineCostModel(num_params=1e9, memory_bandwidth=1e12, peak_flops=1e14, **options)


def test_roofline_flat_then_linear_with_knee():
    model = _roofline()
    memory_time = model.param_bytes / model.memory_bandwidth
    knee = memory_time * model.peak_flops / model.flops_per_token
    assert model.flops_per_token == 2e9
    assert knee == pytest.approx(100.0)
    assert model.knee_batch_size == pytest.approx(knee)
    out = model.step_seconds(_b(1, 10, 50, knee, 2 * knee, 4 * knee))
    torch.testing.assert_close(out, _b(*[memory_time] * 4, 2 * memory_time, 4 * memory_time))
    just_past = model.step_seconds(_b(knee + 1)).item()
    assert just_past > memory_time


def test_roofline_efficiencies_and_overhead():
    model = _roofline(bandwidth_efficiency=0.5, flops_efficiency=0.25, launch_overhead_s=1e-3)
    memory_time = 2e9 / (1e12 * 0.5)
    assert model.memory_seconds == pytest.approx(memory_time)
    # compute per token 2e9 / 2.5e13 = 8e-5 s → knee at 4e-3 / 8e-5 = 50
    assert model.knee_batch_size == pytest.approx(50.0)
    torch.testing.assert_close(model.step_seconds(_b(1, 100)), _b(1e-3 + memory_time, 1e-3 + 8e-3))


def test_roofline_kv_reads_move_the_knee():
    # 1e5 bytes/token × 100 tokens of context = 1e7 bytes per token of B → 1e-5 s at 1e12 B/s.
    model = _roofline(kv_bytes_per_token=1e5, context_length=100)
    torch.testing.assert_close(model.step_seconds(_b(1)), _b(2e-3 + 1e-5))
    assert model.knee_batch_size == pytest.approx(2e-3 / (2e-5 - 1e-5))
    memory_bound = _roofline(kv_bytes_per_token=1e6, context_length=100)
    assert memory_bound.knee_batch_size == math.inf


def test_roofline_explicit_flops_per_token():
    assert _roofline(flops_per_token=4e9).knee_batch_size == pytest.approx(50.0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("memory_bandwidth", 0),
        ("peak_flops", -1.0),
        ("bytes_per_param", math.nan),
        ("bandwidth_efficiency", 1.5),
        ("flops_efficiency", 0.0),
        ("launch_overhead_s", -1e-3),
        ("accounting", "ragged"),
    ],
)
def test_roofline_validation(option, value):
    config = {"num_params": 1e9, "memory_bandwidth": 1e12, "peak_flops": 1e14, option: value}
    with pytest.raises(ValueError, match=option):
        RooflineCostModel(**config)


def test_gpu_presets_have_datasheet_figures_and_sources():
    assert set(GPU_PRESETS) >= {"h200", "h100", "a100"}
    for key, spec in GPU_PRESETS.items():
        assert isinstance(spec, GPUSpec)
        assert spec.source.startswith("https://www.nvidia.com/en-us/data-center/")
        assert key in spec.source
    assert GPU_PRESETS["h200"].memory_bandwidth == 4.8e12
    assert GPU_PRESETS["h100"].memory_bandwidth == 3.35e12
    assert GPU_PRESETS["a100"].memory_bandwidth == 2.039e12
    assert GPU_PRESETS["h200"].peak_flops == GPU_PRESETS["h100"].peak_flops == 989e12
    assert GPU_PRESETS["a100"].peak_flops == 312e12


def test_for_gpu_and_unknown_preset():
    model = RooflineCostModel.for_gpu("H200", num_params=8e9, launch_overhead_s=1e-4)
    assert model.memory_bandwidth == 4.8e12 and model.param_bytes == 16e9
    assert model.launch_overhead_s == 1e-4
    with pytest.raises(ValueError, match=r"unknown GPU preset 'v100'; known: a100, h100, h200"):
        RooflineCostModel.for_gpu("v100", num_params=1e9)


# Target shapes: KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes/element.


def test_kv_bytes_per_token_of_llama_3_1_8b_and_smollm2():
    assert kv_bytes_per_token(32, 8, 128) == 131072.0  # 2 · 32 · 8 · 128 · 2 bytes (bf16)
    assert kv_bytes_per_token(32, 8, 128, bytes_per_element=1) == 65536.0  # fp8 cache
    assert TARGET_SHAPES["llama-3.1-8b"].kv_bytes_per_token() == 131072.0
    assert TARGET_SHAPES["smollm2-135m"].kv_bytes_per_token() == 23040.0  # 2 · 30 · 3 · 64 · 2
    assert TARGET_SHAPES["qwen3-8b"].kv_bytes_per_token() == 147456.0  # 2 · 36 · 8 · 128 · 2
    assert TARGET_SHAPES["llama-3.1-70b"].kv_bytes_per_token() == 327680.0  # 2 · 80 · 8 · 128 · 2


def _dense_params(vocab, hidden, inter, layers, heads, kv_heads, head_dim, tied, qk_norm=False):
    """Parameters of a Llama-style decoder counted longhand from its config."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden + (2 * head_dim if qk_norm else 0)
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def test_target_shapes_match_their_configs():
    # The config.json figures of each model (see each shape's source).
    assert TARGET_SHAPES["smollm2-135m"].num_params == _dense_params(49152, 576, 1536, 30, 9, 3, 64, True)
    assert TARGET_SHAPES["llama-3.1-8b"].num_params == _dense_params(128256, 4096, 14336, 32, 32, 8, 128, False)
    assert TARGET_SHAPES["qwen3-8b"].num_params == _dense_params(151936, 4096, 12288, 36, 32, 8, 128, False, True)
    assert TARGET_SHAPES["llama-3.1-70b"].num_params == _dense_params(128256, 8192, 28672, 80, 64, 8, 128, False)
    llama = TARGET_SHAPES["llama-3.1-8b"]
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert all(s.source.startswith("https://huggingface.co/") for s in TARGET_SHAPES.values())


def test_kv_bytes_per_token_from_a_hf_config():
    from transformers import LlamaConfig

    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token_from_config(llama) == 131072.0  # head_dim = 4096 / 32
    assert kv_bytes_per_token_from_config({**llama, "head_dim": 64}) == 65536.0  # explicit head_dim wins
    mha = {k: v for k, v in llama.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token_from_config(mha) == 2 * 32 * 32 * 128 * 2  # no GQA: every head cached
    smol = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token_from_config(smol) == 23040.0
    assert kv_bytes_per_token_from_config(smol, bytes_per_element=4) == 46080.0
    with pytest.raises(ValueError, match="the config needs num_hidden_layers"):
        kv_bytes_per_token_from_config({"hidden_size": 4096})


def test_for_target_and_the_registered_factory():
    model = RooflineCostModel.for_target("h200", "llama-3.1-8b")
    assert model.num_params == 8_030_261_248 and model.kv_bytes_per_token == 131072.0
    assert model.memory_bandwidth == 4.8e12 and model.peak_flops == 989e12 and model.param_bytes == 16_060_522_496
    assert dspark.get_cost_model("roofline", gpu="h200", target="llama-3.1-8b") == model
    fp8 = RooflineCostModel.for_target("H100", "Qwen3-8B", bytes_per_param=1, launch_overhead_s=1e-4)
    assert fp8.kv_bytes_per_token == 73728.0 and fp8.param_bytes == 8_190_735_360 and fp8.launch_overhead_s == 1e-4
    assert RooflineCostModel.for_target("h200", "llama-3.1-8b", kv_bytes_per_token=1.0).kv_bytes_per_token == 1.0
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    from_config = RooflineCostModel.for_target("a100", config, num_params=134_515_008)
    assert from_config.kv_bytes_per_token == 23040.0 and from_config.memory_bandwidth == 2.039e12
    with pytest.raises(ValueError, match="a target given as a config needs num_params="):
        RooflineCostModel.for_target("a100", config)
    no_gpu = dspark.get_cost_model("roofline", target="smollm2-135m", memory_bandwidth=1e12, peak_flops=1e14)
    assert no_gpu.num_params == 134_515_008 and no_gpu.memory_bandwidth == 1e12


def test_unknown_target_shape_names_the_known_ones():
    known = "known: llama-3.1-70b, llama-3.1-8b, qwen3-8b, smollm2-135m"
    with pytest.raises(ValueError, match=f"unknown target shape 'gpt-9'; {known}"):
        RooflineCostModel.for_target("h200", "gpt-9")
    with pytest.raises(ValueError, match="unknown target shape 'gpt-9'"):
        dspark.get_cost_model("roofline", gpu="h200", target="gpt-9")


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_roofline_num_requests_validation(value):
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1 or None"):
        _roofline(num_requests=value)


# --------------------------------------------------------------------------------------------
# Protocol
# --------------------------------------------------------------------------------------------


def test_models_satisfy_the_protocol():
    table = SPSTableCostModel.from_file(default_profile_path())
    roofline = RooflineCostModel.for_gpu("a100", num_params=1e9)
    assert isinstance(table, CostModel) and table.name == "sps-table"
    assert isinstance(roofline, CostModel) and roofline.name == "roofline"
    for model in (table, roofline):
        sizes = torch.tensor([1, 8, 64])
        torch.testing.assert_close(model.sps(sizes), 1.0 / model.step_seconds(sizes))


def test_models_are_frozen():
    from attrs.exceptions import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        _table().interpolation = "step"
    with pytest.raises(FrozenInstanceError):
        _roofline().num_params = 1.0


def test_profile_cli_writes_a_profile_the_sps_table_reads(tmp_path, capsys):
    """`dspark profile` on a tiny HF folder: shapes over two contexts, a loadable sps-table profile."""
    import json

    import dspark
    from dspark.cli import main

    tiny_causal_lm(num_layers=2, init_range=0.02, keep_eos=True).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "p.json"
    assert main(["profile", "--target", str(tmp_path / "tiny"), "--out", str(out), "--requests", "1,2",
                 "--widths", "1,3", "--contexts", "16,40", "--repeats", "2", "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["accounting"] == "padded" and data["dtype"] == "float32" and data["threads"] >= 1
    assert [p["batch_size"] for p in data["points"]] == [1, 2, 3, 6]  # B = R · (1 + ℓ)
    assert {(p["context"], p["num_requests"]) for p in data["plain_steps"]} == {(c, r) for c in (16, 40) for r in (1, 2)}
    shapes = json.loads(out.with_suffix(".shapes.json").read_text())
    assert {(s["context"], s["requests"], s["tokens_per_request"]) for s in shapes} == {
        (c, r, w) for c in (16, 40) for r in (1, 2) for w in (1, 3)}
    cost = dspark.get_cost_model("sps-table", profile=str(out))
    assert float(cost.step_seconds(torch.tensor([6]))[0]) > 0
    floor = json.loads(out.with_suffix(".floor.json").read_text())
    assert floor["step"] == "packed" and floor["traffic_floor"]["floor_seconds"] > 0
    printed = capsys.readouterr().out
    assert "memory-traffic floor" in printed and "| R \\ 1+ℓ | 1 | 3 | plain |" in printed
    assert main(["profile", "--target", str(tmp_path / "tiny"), "--contexts", "200", "--quiet",
                 "--out", str(out)]) == 2
    assert "exceeds the target's context window" in capsys.readouterr().err


def test_whole_batch_sizes_read_from_the_lookup_table_match_the_interpolation():
    """step_seconds at whole B comes from a table built once per model; it must equal the fitted
    curve interpolated by table_step_seconds, and fractional / out-of-table B still interpolate."""
    from dspark.cost_models import fitted_curves

    model = SPSTableCostModel.from_points({1: 0.05, 4: 0.049, 8: 0.06, 32: 0.09, 64: 0.2})
    (_, pts, _), = fitted_curves(model.profile)
    sizes = torch.tensor([b for b, _ in pts], dtype=torch.float64)
    seconds = torch.tensor([t for _, t in pts], dtype=torch.float64)
    B = torch.arange(1, 65, dtype=torch.float64)
    assert torch.equal(model.step_seconds(B), table_step_seconds(B, sizes, seconds))
    odd = _b(2.5, 0.0, 100, 1000)
    assert torch.equal(model.step_seconds(odd), table_step_seconds(odd, sizes, seconds))
    assert model.batch_overhead_seconds(3) == model.batch_overhead_seconds(3) == 0.0
