"""Shared parts of the natural-prompt source: items, source units and keys, the split side."""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

from attrs import frozen

from dspark.data.prompts import Prompt, jsonl_lines

RESERVED_FRACTION = 0.1  # units hashed below this never train (the shipped eval set lives there)
SHIPPED_EVAL = Path(__file__).parents[1] / "natural_eval.jsonl"
_OWN = ("dspark",)  # this project's own distributions change with every commit: not a source


@frozen
class NaturalItem:
    prompt: Prompt
    unit: str  # what the split is keyed on: distribution, file, math frame + index, first turn
    source: str  # source_key() of the real text the prompt was built from
    rank: int = 0  # 1: a second request about the same source (training only, after every first one)


def band(key: str) -> float:
    """A stable position in [0, 1) for a string (sha1)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def source_key(text: str) -> str:
    """Hash of a source text, insensitive to case, indentation and line wrapping."""
    return hashlib.sha1(" ".join(text.lower().split()).encode("utf-8")).hexdigest()[:16]


def item_side(unit: str, source: str, eval_fraction: float, reserved: set[str] | None = None) -> str | None:
    """``"eval"``, ``"train"`` or ``None`` (neither) for an item of ``unit`` built from ``source``.

    Held out: the unit hashes below ``eval_fraction``. Training: the unit hashes at or above
    ``max(eval_fraction, RESERVED_FRACTION)``, and the source text occurs in no held-out unit —
    checked exactly against ``reserved`` (every source key of the reserved units) for sources that
    can be enumerated whole, else by a hash band of the source key itself (held-out items then
    need a low source band, training items a high one)."""
    cut = max(eval_fraction, RESERVED_FRACTION)
    u = band("unit:" + unit)
    if reserved is None:
        s = band("source:" + source)
        return "eval" if u < eval_fraction and s < cut else "train" if u >= cut and s >= cut else None
    return "eval" if u < eval_fraction else "train" if u >= cut and source not in reserved else None


@functools.lru_cache(maxsize=4)
def shipped_eval_keys(path: str = str(SHIPPED_EVAL)) -> frozenset[str]:
    """Source keys of the shipped natural eval set (never used for training)."""
    if not Path(path).is_file():
        return frozenset()
    return frozenset(json.loads(line).get("source", "") for _, line in jsonl_lines(path, path))


def _rng(*parts: object) -> random.Random:
    return random.Random(":".join(map(str, parts)))
