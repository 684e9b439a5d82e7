"""Output folders dspark may replace, and how it replaces them.

The rule for every writer: a folder is replaced only when it is absent, empty, or was itself
written by dspark (it holds :data:`MARKER`), and never when it is one of the command's inputs or
holds one. The new content is built in a temporary sibling of the output (never inside it), the
old folder is moved aside, the new one renamed into place, and only then the old one removed — so
an interrupted write leaves either the old folder or the new one, never a mix or nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MARKER", "OutputError", "check_replaceable", "build_beside", "swap_in"]

MARKER = ".dspark-output"  # an empty file in every folder dspark writes whole


class OutputError(ValueError):
    """An output folder dspark must not replace."""


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_replaceable(out: str | Path, *, overwrite: bool, sources: Iterable[str | Path] = ()) -> Path:
    """``out`` resolved, or :class:`OutputError` with one sentence when writing there would replace
    something dspark did not write (module docstring)."""
    out = Path(out).resolve()
    for src in sources:
        src = Path(src).resolve()
        if _inside(src, out):
            what = "is" if src == out else "holds"
            raise OutputError(f"the output folder {out} {what} the input {src}; choose another output folder")
    if out == Path(out.anchor) or out == Path.home().resolve():
        raise OutputError(f"refusing to write over {out}; choose a new folder")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"the output {out} exists and is not a folder")
        if any(out.iterdir()):
            if not overwrite:
                raise OutputError(f"the output folder {out} exists and is not empty (pass --overwrite to "
                                  "replace a folder dspark wrote)")
            if not (out / MARKER).is_file():
                raise OutputError(f"the output folder {out} was not written by dspark (no {MARKER} in it), so "
                                  "--overwrite will not replace it; choose a new folder or empty it yourself")
    return out


def build_beside(out: Path) -> Path:
    """A new empty temporary folder next to ``out`` (same file system, so the swap is a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def swap_in(tmp: Path, out: Path) -> Path:
    """Mark ``tmp`` as dspark's and put it in place of ``out`` (see the module docstring)."""
    (tmp / MARKER).touch()
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old / out.name, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
