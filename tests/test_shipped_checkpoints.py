"""What the package ships for the embedded target: the default drafter among the shipped ones, each
with its calibration and training record, within the 60 MB budget (issue 12), and every one of their
files matched by pyproject's package-data (so a wheel carries what a checkout has)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from dspark.checkpoints import DEFAULT_DRAFTER, ROOT, resolve_checkpoint, shipped

BUDGET_BYTES = 60 * 2**20
REPO = Path(__file__).resolve().parents[1]


def test_the_default_drafter_is_shipped_with_its_calibration_and_training_record():
    assert DEFAULT_DRAFTER in shipped()
    for name in shipped():
        folder = resolve_checkpoint(name)
        for part in ("config.json", "model.safetensors", "calibration.json", "train.json"):
            assert (folder / part).is_file(), f"shipped drafter {name} has no {part}"
        assert json.loads((folder / "train.json").read_text())["steps"] > 0


def test_shipped_checkpoints_fit_the_budget():
    files = [p for p in ROOT.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= BUDGET_BYTES, f"shipped checkpoints hold {total / 2**20:.1f} MB, over the 60 MB budget"


def test_package_data_covers_every_shipped_file():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11's tomllib")
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dspark"]
    package = ROOT.parents[1]  # src/dspark
    missed = [str(p.relative_to(package)) for p in ROOT.rglob("*") if p.is_file()
              and not any(fnmatch.fnmatch(str(p.relative_to(package)), g) for g in globs)]
    assert not missed, f"not in pyproject's package-data, so not in a wheel: {missed}"


def test_the_default_drafter_ships_a_calibrated_stacked_confidence_for_its_gamma():
    """dspark-5l-xl's confidence.json (docs/reports/2026-12-04-trained-drafters.md, "Confidence features"): a `stacked` model
    with one weights row per draft position, calibrated itself, so the folder's calibrator is none
    while its calibration.json (the head's, for vLLM / TensorRT-LLM) still loads; the cut
    vocabulary variant keeps that calibration."""
    from dspark.calibration import load_calibrator
    from dspark.confidence import StackedConfidence, load_confidence_model
    from dspark.drafters.checkpoint import read_config
    from dspark.evaluation.drafter_specs import folder_calibrator

    folder = resolve_checkpoint(DEFAULT_DRAFTER)
    model = load_confidence_model(folder)
    assert isinstance(model, StackedConfidence) and model.calibrated
    assert len(model.weights) == read_config(folder).gamma
    assert folder_calibrator(folder) is None
    assert folder_calibrator(folder, 8192) == load_calibrator(folder / "calibration.json")
