"""Drafter → ONNX graphs + ``manifest.json`` (:func:`export_onnx`).

The graphs are traced with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) in
fp32, with named inputs/outputs and dynamic axes (see :mod:`dspark.drafters.graphs`). Each file is
checked with ``onnx.checker`` and hashed. Graphs whose weights would pass the 2 GB protobuf limit
(or every graph, with ``external_data=True``) keep their weights in one ``<graph>.onnx.data`` file
next to them, which ONNX Runtime and TensorRT's parser pick up by themselves.

Reduced-precision variants (``precisions=("fp16",)`` → ``<graph>.fp16.onnx``, likewise bf16) are
traced by :mod:`dspark.export.reduced_precision`.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
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
from dspark.export.reduced_precision import (
    REDUCED_PRECISIONS,
    ReducedPrecisionGraph,
    norm_scopes,
    softmax_in_fp32,
    variant_file,
)

__all__ = ["DEFAULT_OPSET", "export_onnx", "prepare_out_dir"]

DEFAULT_OPSET = 17
CALIBRATION_FILE = "calibration.json"  # a checkpoint folder's calibrator (dspark.evaluation.drafter_specs.calibrator_beside)
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
    entries = [*(old.get("graphs") or {}).values(), *(old.get("engines") or {}).values(),
               *(old.get("scheduling") or {}).values()]
    for variant in (old.get("graph_variants") or {}).values():
        entries += list(variant.values())
    for entry in entries:
        if isinstance(entry, dict):
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


def check_opset(opset: int) -> None:
    """An :class:`ExportError` in one sentence for an opset the graphs or the exporter cannot use."""
    if opset < 17:
        raise ExportError(f"opset {opset} is too old: the graphs need opset 17 or newer")
    newest = _newest_opset()
    if newest is not None and opset > newest:
        raise ExportError(f"opset {opset} is newer than the exporter here knows (up to {newest}); choose 17..{newest}")


def _newest_opset() -> int | None:
    """The newest ONNX opset torch's exporter can write here (None: onnx is not installed)."""
    try:
        import onnx
    except ImportError:
        return None
    newest = onnx.defs.onnx_opset_version()
    try:
        from torch.onnx._constants import ONNX_MAX_OPSET  # the TorchScript exporter's own ceiling
        newest = min(newest, ONNX_MAX_OPSET)
    except ImportError:
        pass
    return newest


def _export_one(spec: GraphSpec, out: Path, opset: int, external_data: bool | None,
                precision: str = "fp32") -> dict[str, Any]:
    onnx = _require_onnx()
    file = variant_file(spec.name, precision)
    final = out / file
    module = spec.module
    if precision != "fp32":
        module = ReducedPrecisionGraph(copy.deepcopy(spec.module), REDUCED_PRECISIONS[precision])
    external = external_data if external_data is not None else _nbytes(module) > _EXTERNAL_DATA_BYTES
    with tempfile.TemporaryDirectory(dir=out, prefix=f".{spec.name}-") as tmp:
        tmp_file = Path(tmp) / file
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings and the TorchScript-exporter deprecation
            torch.onnx.export(
                module.eval(), spec.example, str(tmp_file), dynamo=False, opset_version=opset,
                input_names=list(spec.inputs), output_names=list(spec.outputs),
                dynamic_axes=spec.dynamic_axes, do_constant_folding=True,
            )
        data_name = f"{file}.data"
        for stale in (final, out / data_name):
            if stale.exists():
                stale.unlink()
        split = len(os.listdir(tmp)) > 1  # the exporter may already have split out weights
        softmax_casts = 0
        if external or split or precision != "fp32":
            model = onnx.load(str(tmp_file), load_external_data=False)
            if precision != "fp32":
                softmax_casts = softmax_in_fp32(model, precision)
            onnx.external_data_helper.load_external_data_for_model(model, tmp)
            if external or split:
                onnx.save_model(model, str(final), save_as_external_data=True, all_tensors_to_one_file=True,
                                location=data_name, size_threshold=1024)
            else:
                onnx.save_model(model, str(final))
            del model
        else:
            shutil.move(str(tmp_file), final)
    try:
        onnx.checker.check_model(str(final))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported {file} does not pass onnx.checker: {exc}") from None
    model = onnx.load(str(final), load_external_data=False)
    entry: dict[str, Any] = {
        "file": file,
        "purpose": spec.purpose,
        "sha256": sha256_file(final),
        "bytes": final.stat().st_size,
        **onnx_io(model),
        "bakes_target_weights": spec.bakes_target_weights,
    }
    if precision == "fp32":
        entry["norm_scopes"] = norm_scopes(spec.module, model)
    else:
        entry["compute_dtype"] = {"fp16": "float16", "bf16": "bfloat16"}[precision]
        entry["fp32_parts"] = "RMSNorm (mean of squares, rsqrt), Softmax; fp32 inputs and outputs"
        entry["softmax_casts_added"] = softmax_casts
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


def _scheduling_files(drafter: Any, checkpoint: str | Path | None, out: Path) -> dict[str, dict[str, str]]:
    """Write what the PyTorch drafter schedules with next to the graphs, so the exported drafter
    schedules alike: its confidence model (``drafter.confidence_model``, a checkpoint folder's
    ``confidence.json``; none for a vocabulary cut) and the checkpoint's ``calibration.json`` (read
    with :func:`dspark.evaluation.drafter_specs.calibrator_beside`, from either folder). → manifest entries."""
    from dspark.confidence import CONFIDENCE_FILE

    entries = {}
    model = getattr(drafter, "confidence_model", None)
    if model is not None:
        model.save(out / CONFIDENCE_FILE)
        entries["confidence"] = CONFIDENCE_FILE
    cal = Path(checkpoint) / CALIBRATION_FILE if checkpoint is not None else None
    if cal is not None and cal.is_file():
        shutil.copyfile(cal, out / CALIBRATION_FILE)
        entries["calibration"] = CALIBRATION_FILE
    return {name: {"file": file, "sha256": sha256_file(out / file)} for name, file in entries.items()}


def export_onnx(
    drafter: Any,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    target_spec: str | None = None,
    checkpoint: str | Path | None = None,
    external_data: bool | None = None,
    progress: Progress | None = None,
    precisions: Sequence[str] = (),
) -> dict[str, Any]:
    """Export a bound neural drafter (DSpark, DFlash or Eagle3) to ``out_dir``; returns the manifest.

    ``target_spec`` (what ``load_target`` was given) and ``checkpoint`` are recorded in the
    manifest. ``external_data``: None = only when a graph's weights exceed 1.5 GiB.
    ``precisions`` ("fp16", "bf16"): also write ``<graph>.<precision>.onnx`` — weights and
    activations in that precision, RMSNorm and Softmax in fp32, fp32 I/O — listed in the
    manifest's ``graph_variants``; strongly typed TensorRT builds (TensorRT 11) need them.
    The drafter's confidence model and ``checkpoint``'s ``calibration.json`` are written beside the
    graphs (manifest ``scheduling``), and the exported drafter applies them as the PyTorch one does.
    """
    _require_onnx()
    check_opset(opset)
    unknown = [p for p in precisions if p not in REDUCED_PRECISIONS]
    if unknown:
        raise ExportError(f"unknown graph precision {unknown[0]!r}: choose from {', '.join(REDUCED_PRECISIONS)}")
    config = getattr(drafter, "config", None)
    if config is None or not callable(getattr(drafter, "loop_spec", None)):
        raise ExportError(
            f"{type(drafter).__name__} is not a neural dspark drafter (a registered drafter kind: "
            f"{', '.join(kind_names())})"
        )
    if not drafter.is_bound:
        raise ExportError("the drafter is not bound to a target: load it with from_pretrained(path, target)")
    if checkpoint is not None and Path(out_dir).resolve() == Path(checkpoint).resolve():
        # the export writes (and a re-export removes) confidence.json / calibration.json in OUT:
        # into the checkpoint folder itself that would overwrite, then delete, the checkpoint's own
        raise ExportError(f"the output folder {out_dir} is the checkpoint folder itself; export into another folder")
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
    variants: dict[str, dict[str, Any]] = {}
    for precision in dict.fromkeys(precisions):
        variants[precision] = {}
        for spec in specs:
            if progress:
                progress(f"exporting {variant_file(spec.name, precision)}")
            variants[precision][spec.name] = _export_one(spec, out, opset, external_data, precision)
    s = config.layer
    embed, lm_head = drafter.target_weights()
    tied = embed.data_ptr() == lm_head.data_ptr()
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
                "embedding_sha256": sha256_tensor(embed),
                "lm_head_sha256": sha256_tensor(lm_head),
            },
        },
        "checkpoint": _checkpoint_info(checkpoint),
        "versions": versions(),
        "graphs": graphs,
    }
    if variants:
        manifest["graph_variants"] = variants
    scheduling = _scheduling_files(drafter, checkpoint, out)
    if scheduling:
        manifest["scheduling"] = scheduling
    write_manifest(out, manifest)
    return manifest


def attrs_dict(value: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(value)
