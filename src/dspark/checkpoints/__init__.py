"""Drafters trained for the embedded SmolLM2-135M-Instruct target, shipped with the package.

Each folder under ``smollm2-135m/`` is a ``save_pretrained`` checkpoint (``config.json``,
``model.safetensors`` with int8 row-wise storage, ``calibration.json`` where fitted) plus the
``train.json`` that records how it was trained. ``eval_prompts.jsonl`` holds the held-out
evaluation prompts (disjoint from the training prompts by prompt hash).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT", "DEFAULT_DRAFTER", "shipped", "locate", "resolve_checkpoint", "eval_prompts_path"]

ROOT = Path(__file__).parent / "smollm2-135m"
# The main job's drafter: the paper's configuration in the reference layout (5 Qwen3 draft layers,
# vanilla head, full vocabulary), trained 10,000 steps on the 1 M-token natural data (dspark-5l's
# 3,000, continued by 4,000 as dspark-5l-long, then by 3,000 more), so
# `dspark convert --drafter dspark-5l-xl --out OUT --to speculators --target smollm2-135m` gives what vLLM serves.
# The baselines are the paper configuration's runs in the reference layout too (so they convert the
# same way): `dflash` is the run dflash-5l (5 draft layers, full vocabulary) and `eagle3` the run
# eagle3-1l (1 layer, 4,096-token draft vocabulary), trained 3,000 steps on the same data.
# Drafters shipped before left the tree; git history keeps them (data/smollm2-135m/README.md).
DEFAULT_DRAFTER = "dspark-5l-xl"


def shipped() -> list[str]:
    """Names of the shipped drafters (folders with a config.json)."""
    return sorted(p.name for p in ROOT.iterdir() if (p / "config.json").is_file()) if ROOT.is_dir() else []


def locate(name_or_path: str | Path) -> Path:
    """The shipped drafter called ``name_or_path`` unless that path is itself a checkpoint folder;
    otherwise the path as given (so a loader reports what is wrong with it)."""
    p = Path(name_or_path)
    shipped_dir = ROOT / str(name_or_path)
    if not (p / "config.json").is_file() and (shipped_dir / "config.json").is_file():
        return shipped_dir
    return p


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A checkpoint folder: an existing path, or the name of a shipped drafter."""
    p = locate(name_or_path)
    if (p / "config.json").is_file():
        return p
    raise FileNotFoundError(
        f"{name_or_path} is neither a drafter checkpoint folder (no config.json) nor a shipped drafter "
        f"(shipped: {', '.join(shipped()) or 'none'})"
    )


def eval_prompts_path() -> Path:
    return ROOT / "eval_prompts.jsonl"
