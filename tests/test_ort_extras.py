"""The `onnx` and `onnx-gpu` extras install one module from two distributions: a user who has both
is told so, once, when the onnxruntime backend loads."""

from __future__ import annotations

import logging

import pytest

ort = pytest.importorskip("dspark.export.ort")


@pytest.mark.parametrize("installed, warned", [(["onnxruntime"], False), (["onnxruntime", "onnxruntime-gpu"], True)])
def test_both_onnxruntime_distributions_are_named_once(monkeypatch, caplog, installed, warned):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "ort_distributions", lambda: installed)
    ort._warn_if_both_installed.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dspark.export.ort"):
            ort._require_ort()
            ort._require_ort()
    finally:
        ort._warn_if_both_installed.cache_clear()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ([
        "both onnxruntime and onnxruntime-gpu are installed and share one onnxruntime module, so which one runs "
        "is whichever pip installed last: keep one (pip uninstall onnxruntime, for the CUDA provider)"] if warned else [])


def test_the_distributions_are_read_from_the_environment():
    import importlib.metadata

    found = ort.ort_distributions()
    for name in found:
        assert importlib.metadata.distribution(name).metadata["Name"].lower().replace("_", "-") == name
