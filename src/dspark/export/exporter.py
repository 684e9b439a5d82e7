"""Drafter → ONNX graphs + ``manifest.json`` (:func:`export_onnx`).

The graphs are traced with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) in
fp32, with named inputs/outputs and dynamic axes (see :mod:`dspark.drafters.graphs`). Each file is
checked with ``onnx.checker`` and hashed. Graphs whose weights would pass the 2 GB protobuf limit
(or every graph, with ``external_data=True``) keep their weights in one ``<graph>.onnx.data`` file
next to them, which ONNX Runtime and TensorRT's parser pick up by themselves.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark.drafters.graphs import GraphSpec, graph_specs
from dspark.drafters.kinds import kind_names
from dspark.export.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ExportError,
    onnx_io,
    read_manifest,
    sha256_file,
    sha256_tensor,
    versions,
    write_manifest,
)

__all__ = ["DEFAULT_OPSET", "export_onnx", "prepare_out_dir"]

DEFAULT_OPSET = 17
_EXTERNAL_DATA_BYTES = 1536 << 20  # weights above this go to <graph>.onnx.data (protobuf limit: 2 GiB)

Progress = Callable[[str], None]


def _require_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ExportError("exporting needs the onnx package: pip install 'dspark[onnx]'") from None
    return onnx


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` (and parents) and make sure files can be written there."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ExportError(f"cannot write to the output folder {out}: {reason}") from None
    return out


def _remove_previous(out: Path) -> None:
    """Delete the files a previous export listed in this folder (a stale engine must not linger)."""
    if not (out / MANIFEST_NAME).is_file():
        return
    try:
        old = read_manifest(out)
    except ExportError:
        return
    for section in ("graphs", "engines"):
        for entry in (old.get(section) or {}).values():
            for rel in [entry.get("file"), *entry.get("external_data", {})]:
                if rel and (out / rel).is_file() and Path(rel).name == rel:
                    (out / rel).unlink()


def _nbytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _export_one(spec: GraphSpec, out: Path, opset: int, external_data: bool | None) -> dict[str, Any]:
    onnx = _require_onnx()
    final = out / spec.file
    external = external_data if external_data is not None else _nbytes(spec.module) > _EXTERNAL_DATA_BYTES
    with tempfile.TemporaryDirectory(dir=out, prefix=f".{spec.name}-") as tmp:
        tmp_file = Path(tmp) / spec.file
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings and the TorchScript-exporter deprecation
            torch.onnx.export(
                spec.module.eval(), spec.example, str(tmp_file), dynamo=False, opset_version=opset,
                input_names=list(spec.inputs), output_names=list(spec.outputs),
                dynamic_axes=spec.dynamic_axes, do_constant_folding=True,
            )
        data_name = f"{spec.file}.data"
        for stale in (final, out / data_name):
            if stale.exists():
                stale.unlink()
        if external or len(os.listdir(tmp)) > 1:  # the exporter may already have split out weights
            model = onnx.load(str(tmp_file), load_external_data=True)
            onnx.save_model(model, str(final), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            del model
        else:
            shutil.move(str(tmp_file), final)
    try:
        onnx.checker.check_model(str(final))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported {spec.file} does not pass onnx.checker: {exc}") from None
    model = onnx.load(str(final), load_external_data=False)
    entry: dict[str, Any] = {
        "file": spec.file,
        "purpose": spec.purpose,
        "sha256": sha256_file(final),
        "bytes": final.stat().st_size,
        **onnx_io(model),
        "bakes_target_weights": spec.bakes_target_weights,
    }
    if (out / data_name).is_file():
        entry["external_data"] = {data_name: sha256_file(out / data_name)}
        entry["bytes"] += (out / data_name).stat().st_size
    return entry


def _checkpoint_info(checkpoint: str | Path | None) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    root = Path(checkpoint)
    files = {p.name: sha256_file(p) for p in sorted(root.iterdir()) if p.is_file()} if root.is_dir() else {}
    return {"path": str(root.resolve()), "sha256": files}


def export_onnx(
    drafter: Any,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    target_spec: str | None = None,
    checkpoint: str | Path | None = None,
    external_data: bool | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Export a bound neural drafter (DSpark, DFlash or Eagle3) to ``out_dir``; returns the manifest.

    ``target_spec`` (what ``load_target`` was given) and ``checkpoint`` are recorded in the
    manifest. ``external_data``: None = only when a graph's weights exceed 1.5 GiB.
    """
    _require_onnx()
    if opset < 17:
        raise ExportError(f"opset {opset} is too old: the graphs need opset 17 or newer")
    config = getattr(drafter, "config", None)
    if config is None or not callable(getattr(drafter, "loop_spec", None)):
        raise ExportError(
            f"{type(drafter).__name__} is not a neural dspark drafter (a registered drafter kind: "
            f"{', '.join(kind_names())})"
        )
    if getattr(drafter, "_embed", None) is None or getattr(drafter, "_lm_head", None) is None:
        raise ExportError("the drafter is not bound to a target: load it with from_pretrained(path, target)")
    out = prepare_out_dir(out_dir)
    _remove_previous(out)
    src = drafter
    if any(p.dtype != torch.float32 for p in drafter.parameters()):
        src = copy.deepcopy(drafter).float()  # graphs are fp32; precision is the engine's choice
    src.eval()
    shape = src.loop_spec()  # what the runtime loop needs to know
    specs = graph_specs(src)
    graphs: dict[str, Any] = {}
    for spec in specs:
        if progress:
            progress(f"exporting {spec.file}")
        graphs[spec.name] = _export_one(spec, out, opset, external_data)
    s = config.layer
    tied = drafter._embed.data_ptr() == drafter._lm_head.data_ptr()
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "kind": config.kind,
        "gamma": config.gamma,
        "vocab_size": config.vocab_size,
        "hidden_size": s.hidden_size,
        "target_layer_ids": list(config.target_layer_ids),
        "feature_size": len(config.target_layer_ids) * s.hidden_size,
        "num_layers": shape.num_layers,  # layers whose context K/V the runtime caches
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "head": config.head if getattr(drafter, "head", None) is not None else None,
        "rank": config.rank,
        "confidence": shape.confidence,
        "stateful_head": shape.stateful_head,
        "returns_hidden": shape.returns_hidden,
        # reduced draft vocabulary: slot i of the logits is target token draft_ids[i] (last: placeholder)
        "draft_ids": drafter.draft_ids.tolist() if getattr(drafter, "vocab_map", None) is not None else None,
        "dtype": "float32",
        "opset": opset,
        "drafter_config": config.to_dict(),
        "target": {
            **attrs_dict(config.target),
            "spec": target_spec,
            "baked_weights": {
                "note": "the target's token embedding and LM head are initializers of the graphs "
                        "marked bakes_target_weights; these files only fit this target",
                "tied": tied,
                "embedding_sha256": sha256_tensor(drafter._embed),
                "lm_head_sha256": sha256_tensor(getattr(drafter, "_lm_head_full", None)
                                                if getattr(drafter, "_lm_head_full", None) is not None
                                                else drafter._lm_head),
            },
        },
        "checkpoint": _checkpoint_info(checkpoint),
        "versions": versions(),
        "graphs": graphs,
    }
    write_manifest(out, manifest)
    return manifest


def attrs_dict(value: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(value)
