"""The committed self-distillation data never trains on the shipped natural-prompt eval set: no
key and no prompt text of src/dspark/data/natural_eval.jsonl is among an archive's training prompts."""

from __future__ import annotations

import functools
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVES = sorted((ROOT / "data" / "smollm2-135m").glob("natural*.tar.xz"))


@functools.cache  # each archive is decompressed once for all the tests here
def _train_rows(archive: Path) -> list[dict]:
    with tarfile.open(archive) as tar:
        f = tar.extractfile("train.jsonl")
        assert f is not None, f"{archive} has no train.jsonl"
        return [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]


def test_the_archives_are_committed():
    assert {a.name for a in ARCHIVES} >= {"natural.tar.xz", "natural15.tar.xz"}


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda a: a.name)
def test_archive_trains_on_no_shipped_eval_prompt(archive):
    rows = _train_rows(archive)
    evals = [json.loads(line) for line in (ROOT / "src/dspark/data/natural_eval.jsonl").read_text().splitlines()
             if line.strip()]
    assert len(evals) >= 30 and len(rows) > 5000  # dspark eval --per-domain 10 takes 30 of them
    keys = {r["key"] for r in rows}
    texts = {json.dumps(r["prompt"]) for r in rows}
    assert not [e["key"] for e in evals if e["key"] in keys]
    assert not [e["key"] for e in evals if json.dumps(e["prompt"]) in texts]


def test_natural15_extends_natural():
    """data15's first responses are data12's, in order (so its teacher cache reuses data12's shards)."""
    small, big = (_train_rows(ROOT / "data" / "smollm2-135m" / n) for n in ("natural.tar.xz", "natural15.tar.xz"))
    assert big[: len(small)] == small and len(big) > len(small)
    assert sum(len(r["response_ids"]) for r in big) >= 1_500_000
