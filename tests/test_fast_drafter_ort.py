"""Sampling through the onnxruntime draft runner (dspark.export.live) keeps the target's law.

The fp32 drafter's graphs run in onnxruntime's CPU sessions while the drafter's own loop samples
from the logits they return; the joint law of the first two tokens the engine emits must be the
target model's own (χ², fixed seeds), as through the compiled runner (test_fast_drafter, which
holds the shared check; kept apart for the size of that module).
"""

from __future__ import annotations

import pytest

from dspark.export.live import LiveOrtRunner
from dspark.fast import FastTarget
from dspark.fast.drafter import use_draft_runner
from test_fast_drafter import _assert_sampling_keeps_the_target_law, _model, needs_onnx
from test_fast_step import _drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@needs_onnx
def test_sampling_through_an_onnxruntime_drafter_matches_the_target():
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, "dspark:gated-markov")
    assert use_draft_runner(drafter, "onnxruntime") == "onnxruntime"
    assert isinstance(drafter.loop.runner, LiveOrtRunner)
    _assert_sampling_keeps_the_target_law(model, target, drafter, "sps-greedy", "onnxruntime drafter / T1")
    assert drafter.loop.runner.path == "onnxruntime"  # no silent fallback to eager
