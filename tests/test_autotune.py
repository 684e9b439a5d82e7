"""Start-up choices by measurement (dspark.autotune): the dtype, its profile, the machine's description.

The timing itself is replaced by known step times (a fake ``measure_profile``), so the tests check
the decision, not this machine's speed; one test runs the real measurement on a tiny model.
"""

from __future__ import annotations

import pytest
import torch

import dspark.autotune as autotune
from dspark.autotune import DtypeChoice, Machine, choose_dtype, profile_cost_model
from helpers import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def _fake_profiles(monkeypatch, table: dict[torch.dtype, dict[int, float]]) -> list[torch.dtype]:
    """Make measure_profile return ``table[dtype of the target's model]``; returns the dtypes timed."""
    timed: list[torch.dtype] = []

    def fake(target, context, widths, repeats=5):
        dtype = next(target.model.parameters()).dtype
        timed.append(dtype)
        return {w: table[dtype][w] for w in widths}

    monkeypatch.setattr(autotune, "measure_profile", fake)
    return timed


# t(q) in seconds, q = 1..4: bf16 faster at one token but growing linearly (emulated bf16)
EMULATED = {torch.float32: {1: 0.040, 2: 0.045, 3: 0.048, 4: 0.050},
            torch.bfloat16: {1: 0.015, 2: 0.021, 3: 0.027, 4: 0.033}}
# bf16 slower at one token (AVX2 only, as the issue's machine: 51 ms against fp32's ~40)
SLOW_BF16 = {torch.float32: {1: 0.040, 2: 0.044, 3: 0.046, 4: 0.047},
             torch.bfloat16: {1: 0.051, 2: 0.072, 3: 0.093, 4: 0.114}}


@pytest.mark.parametrize("table,expected", [(EMULATED, "bfloat16"), (SLOW_BF16, "float32")])
def test_the_faster_plain_step_wins_and_its_profile_is_kept(monkeypatch, table, expected):
    model = tiny_causal_lm()
    timed = _fake_profiles(monkeypatch, table)
    choice, target = choose_dtype(model, None, context=20, gamma=3)
    assert set(timed) == {torch.float32, torch.bfloat16}
    assert choice.dtype == expected and not choice.fixed
    assert choice.profile == table[getattr(torch, expected)]
    assert choice.plain_step_seconds == {"float32": table[torch.float32][1], "bfloat16": table[torch.bfloat16][1]}
    assert next(target.model.parameters()).dtype == getattr(torch, expected)
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is not cast in place
    line = choice.reason
    assert line.startswith(f"dtype {expected} (the faster plain step") and "float32" in line and "bfloat16" in line
    cost = choice.cost_model("tiny")
    assert cost.profile.dtype == expected and cost.profile.model == "tiny"
    assert float(cost.step_seconds(torch.tensor([1]))[0]) == pytest.approx(table[getattr(torch, expected)][1])


def test_a_fixed_dtype_is_not_raced_and_bad_names_are_refused(monkeypatch):
    model = tiny_causal_lm()
    timed = _fake_profiles(monkeypatch, EMULATED)
    choice, _ = choose_dtype(model, None, context=20, gamma=3, dtype="float32")
    assert timed == [torch.float32] and choice.fixed and choice.dtype == "float32"
    assert "fixed by the user" in choice.reason
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        choose_dtype(model, None, context=20, gamma=3, dtype="float16")
    with pytest.raises(ValueError, match="gamma"):
        choose_dtype(model, None, context=20, gamma=-1)
    with pytest.raises(ValueError, match="unknown dtype candidates"):
        choose_dtype(model, None, context=20, gamma=3, candidates=("float32", "int8"))


def test_real_measurement_on_a_tiny_model():
    """No fake: both dtypes are timed for q = 1..γ+1 and the choice is their minimum."""
    choice, target = choose_dtype(tiny_causal_lm(), None, context=16, gamma=2, repeats=2)
    assert set(choice.profile) == {1, 2, 3} and all(s > 0 for s in choice.profile.values())
    assert choice.dtype == min(choice.plain_step_seconds, key=choice.plain_step_seconds.get)
    d = choice.to_dict()
    assert d["machine"]["threads"] == torch.get_num_threads() and d["dtype"] == choice.dtype
    assert target.vocab_size == 32 and not target.request_ids  # the profiling requests were released


def test_profile_cost_model_is_a_non_decreasing_envelope():
    cost = profile_cost_model({1: 0.020, 2: 0.030, 3: 0.025, 4: 0.040}, dtype="bfloat16", model="m", device="cpu")
    got = [float(cost.step_seconds(torch.tensor([q]))[0]) for q in (1, 2, 3, 4)]
    assert got == pytest.approx([0.020, 0.025, 0.025, 0.040])


def test_machine_kinds():
    base = dict(cpu="Some CPU", cores=2, threads=2, capability="AVX512", caps=())
    assert Machine(flags=("avx2", "avx512f", "avx512_bf16"), **base).kind == "AVX-512-BF16"
    assert Machine(flags=("avx2", "amx_bf16", "amx_tile"), **base).kind == "AMX-BF16"
    assert Machine(flags=("avx2", "avx512f"), **base).kind == "AVX-512 only (bf16 emulated)"
    assert Machine(flags=("avx2",), **{**base, "capability": "AVX2"}).kind == "AVX2 only (bf16 emulated)"
    capped = Machine(flags=("avx2", "avx512f", "avx512_bf16"), **{**base, "caps": ("ONEDNN_MAX_CPU_ISA=AVX2",)})
    assert not capped.native_bf16 and capped.kind.startswith("AVX2 only (bf16 emulated) — ONEDNN_MAX_CPU_ISA=AVX2")
    here = Machine.current()
    assert here.cores >= 1 and here.threads == torch.get_num_threads() and here.cpu in here.describe()


def test_dtype_choice_round_trips_to_dict():
    m = Machine("cpu", 2, ("avx2",), 2, "AVX2", ())
    c = DtypeChoice("float32", 100, {"float32": 0.04, "bfloat16": 0.05}, {1: 0.04, 2: 0.05}, False, 1.5, m)
    d = c.to_dict()
    assert d["profile_step_seconds"] == {"1": 0.04, "2": 0.05} and d["machine"]["kind"] == "AVX2 only (bf16 emulated)"
    assert "float32 40.0 ms, bfloat16 50.0 ms" in d["reason"]
