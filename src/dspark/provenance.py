"""Provenance of caches and resumable runs: what a stored result was computed from, so that it is
reused only for the same inputs (a mismatch is refused in one sentence naming the first field that
differs, never silently reused).

* :func:`files_digest` — a digest of a file or folder's bytes (a checkpoint, a prompt file);
* :func:`check` — compare the provenance recorded beside a result with the current one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ProvenanceError", "files_digest", "check", "record"]

# dspark's output marker, and a checkpoint's record of its measured vocabulary cut (a fact about
# the weights beside them: dspark.drafters.vocab_cut), which must not change their digest
_SKIP = {".dspark-output", "vocab_cut.json"}


class ProvenanceError(ValueError):
    """A stored result was computed from other inputs than the current run's."""


def files_digest(path: str | Path) -> str:
    """blake2b of a file's bytes, or of every file under a folder (relative names and bytes, in
    name order; dspark's marker, a vocabulary-cut record and hidden temporary files left out)."""
    path = Path(path)
    h = hashlib.blake2b(digest_size=16)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if f == path else f.relative_to(path).as_posix()
        if f.name in _SKIP or rel.startswith("."):
            continue
        h.update(rel.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def record(path: Path, provenance: Mapping[str, Any]) -> None:
    """Write ``provenance`` beside a result (``path`` is the provenance file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(provenance), indent=2, sort_keys=True) + "\n")


def check(path: Path, provenance: Mapping[str, Any], what: str, remedy: str, *,
          ignore: tuple[str, ...] = ()) -> None:
    """Raise :class:`ProvenanceError` unless ``path`` records exactly ``provenance`` (the keys in
    ``ignore`` left out of the comparison: a check before everything is known).

    ``what`` names the stored result, ``remedy`` says how to proceed (e.g. "pass --fresh")."""
    if not path.is_file():
        raise ProvenanceError(f"{what} has no record of what it was computed from ({path.name} is missing); {remedy}")
    try:
        stored = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProvenanceError(f"{path} is not valid JSON; {remedy}") from None
    if not isinstance(stored, dict):
        raise ProvenanceError(f"{path} does not hold a JSON object; {remedy}")
    current = json.loads(json.dumps(dict(provenance)))  # the JSON form, as stored
    for key in sorted((set(stored) | set(current)) - set(ignore)):
        if stored.get(key) != current.get(key):
            raise ProvenanceError(f"{what} was computed with {key} = {stored.get(key)!r}, this run has "
                                  f"{current.get(key)!r}; {remedy}")
