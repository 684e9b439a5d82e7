"""The committed self-distillation data never trains on the shipped natural-prompt eval set: no
key and no prompt text of src/dspark/data/natural_eval.jsonl is among an archive's training prompts."""

from __future__ import annotations

import functools
import hashlib
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2-135m"
ARCHIVES = ("natural12.tar.xz", "natural15.tar.xz")


def _member(archive: str, name: str) -> bytes:
    with tarfile.open(DATA / archive) as tar:
        f = tar.extractfile(name)
        assert f is not None, f"{archive} has no {name}"
        return f.read()


@functools.cache  # each archive is decompressed once for all the tests here
def _train_bytes(archive: str) -> bytes:
    """train.jsonl of an archive; natural12's is the prefix of natural15's that its prefix.json names."""
    if archive == "natural12.tar.xz":
        prefix = json.loads(_member(archive, "prefix.json"))["train.jsonl"]
        lines = _train_bytes(prefix["from"]).splitlines(keepends=True)[: prefix["first_rows"]]
        data = b"".join(lines)
        assert hashlib.sha256(data).hexdigest() == prefix["sha256"], "natural12's train.jsonl does not hash as recorded"
        return data
    return _member(archive, "train.jsonl")


def _train_rows(archive: str) -> list[dict]:
    return [json.loads(line) for line in _train_bytes(archive).decode("utf-8").splitlines() if line.strip()]


def test_the_archives_are_committed():
    assert all((DATA / a).is_file() for a in ARCHIVES)
    assert json.loads(_member("natural12.tar.xz", "meta.json"))["per_domain"] == 2700


@pytest.mark.parametrize("archive", ARCHIVES)
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
    """data15's first responses are data12's, in order (so its teacher cache reuses data12's shards):
    data12 is stored as that prefix, checked against the sha256 of the file it was generated as."""
    small, big = (_train_rows(n) for n in ARCHIVES)
    assert len(small) == 5982 and len(big) > len(small)
    assert sum(len(r["response_ids"]) for r in big) >= 1_500_000
