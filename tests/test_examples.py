"""Every example runs and does what its docstring says."""

from __future__ import annotations

import runpy
from pathlib import Path

import dspark

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_schedule_and_verify_example():
    summary = runpy.run_path(str(EXAMPLES / "schedule_and_verify.py"))["main"]()
    assert len(summary["lengths"]) == 8
    assert all(a <= n for a, n in zip(summary["accepted"], summary["lengths"]))
    assert all(len(c) == a + 1 for c, a in zip(summary["committed"], summary["accepted"]))
    assert summary["expected_tokens_per_second"] > 0


def test_custom_scheduler_example_registers_and_cleans_up():
    assert runpy.run_path(str(EXAMPLES / "custom_scheduler.py"))["main"]() == [3, 2, 0]
    assert "half" not in {r["name"] for r in dspark.list_plugins()}
