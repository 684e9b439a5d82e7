"""``manifest.json``: what an export folder holds, for whom, made by what, and its checksums.

Written next to the graphs by :func:`dspark.export.export_onnx`, extended with an ``engines``
section by the TensorRT build, read (and its checksums verified) by the runtimes.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "FORMAT", "ExportError", "sha256_file", "sha256_tensor", "versions",
           "read_manifest", "write_manifest", "verify_files", "onnx_io", "graph_entries"]

MANIFEST_NAME = "manifest.json"
FORMAT = "dspark.export"
FORMAT_VERSION = 1


class ExportError(RuntimeError):
    """An export folder, checkpoint, target or engine is missing, corrupt or does not fit.

    The message is one sentence a user can act on (the CLI prints it without a traceback).
    """


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tensor(t: Any) -> str:
    """sha256 of a tensor's fp32 bytes (how it is baked into the graphs)."""
    arr = t.detach().float().contiguous().cpu().numpy()
    return hashlib.sha256(arr.tobytes()).hexdigest()


def versions() -> dict[str, str]:
    import torch

    from dspark import __version__

    out = {"dspark": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("onnx", "onnxruntime", "tensorrt"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or a broken install (a missing libnvinfer: OSError)
            pass
    return out


_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
                11: "float64", 16: "bfloat16"}


def onnx_io(model: Any) -> dict[str, list[dict[str, Any]]]:
    """Inputs and outputs of a loaded ONNX model: name, dtype, shape (ints or axis names)."""

    def describe(values: Any) -> list[dict[str, Any]]:
        rows = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
            rows.append({"name": v.name, "dtype": _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims})
        return rows

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_manifest(root: str | Path) -> dict[str, Any]:
    root = Path(root)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ExportError(f"{root} is not a folder (expected an export folder with {MANIFEST_NAME})")
    if not path.is_file():
        raise ExportError(f"{root} has no {MANIFEST_NAME}; export a drafter there first (python -m dspark.export)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ExportError(f"{path} is not a dspark export manifest (format {got!r})")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ExportError(
            f"{path} has format version {manifest['format_version']}; this dspark reads up to {FORMAT_VERSION}"
        )
    _check_entries(path, "graphs", manifest.get("graphs"), required=True)
    _check_entries(path, "engines", manifest.get("engines"))
    _check_entries(path, "scheduling", manifest.get("scheduling"))
    variants = manifest.get("graph_variants")
    if variants is not None:
        if not isinstance(variants, dict):
            raise ExportError(f"{path}: graph_variants must be an object of precision → graphs")
        for precision, entries in variants.items():
            _check_entries(path, f"graph_variants.{precision}", entries, required=True)
    return manifest


def _plain_name(rel: Any) -> bool:
    """A file name inside the export folder: no folder part, no '..', not absolute."""
    return isinstance(rel, str) and rel not in ("", ".", "..") and Path(rel).name == rel and "\\" not in rel


def _check_entries(path: Path, field: str, entries: Any, *, required: bool = False) -> None:
    """Every entry of a manifest section names a plain file of the export folder and its sha256:
    a hand-edited or hostile manifest is one sentence, never a traceback or a path outside."""
    if entries is None and not required:
        return
    if not isinstance(entries, dict):
        raise ExportError(f"{path}: {field} must be an object of name → entry, got {type(entries).__name__}")
    for name, entry in entries.items():
        where = f"{path}: {field}.{name}"
        if not isinstance(entry, dict):
            raise ExportError(f"{where} must be an object with 'file' and 'sha256'")
        if not _plain_name(entry.get("file")):
            raise ExportError(f"{where}.file must be a file name inside the export folder, got {entry.get('file')!r}")
        if not isinstance(entry.get("sha256"), str):
            raise ExportError(f"{where} has no sha256")
        extra = entry.get("external_data", {})
        if not isinstance(extra, dict) or not all(_plain_name(k) and isinstance(v, str) for k, v in extra.items()):
            raise ExportError(f"{where}.external_data must map file names inside the export folder to sha256s")


def graph_entries(manifest: dict[str, Any], precision: str = "fp32") -> dict[str, Any]:
    """The manifest entries of the graph files of one precision (fp32: ``graphs``)."""
    if precision == "fp32":
        return manifest["graphs"]
    variants = (manifest.get("graph_variants") or {}).get(precision)
    if not variants:
        have = ", ".join(["fp32", *(manifest.get("graph_variants") or {})])
        raise ExportError(f"this export has no {precision} graphs (it has: {have}); export with "
                          f"precisions=[{precision!r}] (python -m dspark.export ... --out DIR --trt --{precision})")
    return variants


def verify_files(root: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Check every listed file (and its external-data files) against the manifest's sha256."""
    for name, entry in entries.items():
        files = {entry["file"]: entry["sha256"], **entry.get("external_data", {})}
        for rel, digest in files.items():
            path = root / rel
            if not path.is_file():
                raise ExportError(f"{path} is missing (listed for {name!r} in {root / MANIFEST_NAME})")
            if sha256_file(path) != digest:
                raise ExportError(
                    f"{path} does not match its checksum in {root / MANIFEST_NAME}; it was changed or "
                    "truncated after export — export again"
                )
