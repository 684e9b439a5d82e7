"""The golden fixtures made by the reference implementations (DeepSpec, speculators).

``tests/fixtures/reference-drafters/`` is a verbatim copy of the project's shared fixtures; its
README defines every tensor and convention. Every file is checked against ``manifest.json``'s
sha256 when first read, so a modified or truncated fixture fails loudly instead of silently
changing what the tests compare against.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).parent / "fixtures" / "reference-drafters"
DEEPSPEC_BLOCK = ("deepspec-dspark-vanilla", "deepspec-dspark-gated", "deepspec-dspark-rnn", "deepspec-dflash")
SPECULATORS = ("speculators-dspark", "speculators-dflash", "speculators-eagle3")


@cache
def _manifest() -> dict[str, Any]:
    return json.loads((ROOT / "manifest.json").read_text())["files"]


def checked(relpath: str) -> Path:
    """The fixture file ``relpath``, after checking its sha256 against the manifest."""
    path = ROOT / relpath
    entry = _manifest().get(relpath)
    if entry is None:
        raise AssertionError(f"{relpath} is not listed in the fixture manifest")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise AssertionError(f"fixture {relpath} does not match its manifest sha256 (modified or corrupt)")
    return path


@cache
def cases(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) of fixture folder ``name``'s cases."""
    from safetensors.torch import load_file

    return load_file(str(checked(f"{name}/cases.safetensors"))), json.loads(checked(f"{name}/cases.json").read_text())


def folder(name: str) -> Path:
    """A checkpoint folder, its config and weights checked."""
    checked(f"{name}/config.json")
    checked(f"{name}/model.safetensors")
    return ROOT / name


@cache
def target_model() -> Any:
    """The fixture's tiny Qwen3 target (float32, eval, SDPA attention as the reference evaluator)."""
    from transformers import AutoModelForCausalLM

    for f in ("config.json", "generation_config.json", "model.safetensors"):
        checked(f"target/{f}")
    model = AutoModelForCausalLM.from_pretrained(
        str(ROOT / "target"), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


def target(capture_layers: tuple[int, ...] = ()) -> Any:
    """An :class:`~dspark.targets.HFTarget` over the fixture target."""
    from dspark.targets import HFTarget

    t = HFTarget(target_model(), capture_layers=capture_layers)
    t.name = "target"
    return t
