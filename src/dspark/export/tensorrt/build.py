"""Engine builds from an export folder's ONNX files: :func:`build_engines` writes one serialized
engine (``<graph>.plan``) per graph and records it in the manifest.

TensorRT 10 and 11 (names checked against NVIDIA's Python API reference and the 10.x → 11.x
migration guide; docs/export.md says what has run on a GPU):

* Both: ``Builder.create_network(flags)`` (explicit batch is the only mode since 10.0; the
  ``EXPLICIT_BATCH`` flag is ignored in 10 and gone in 11), ``OnnxParser.parse_from_file``, one
  ``IOptimizationProfile`` per engine, ``IBuilderConfig.set_memory_pool_limit``,
  ``build_serialized_network``; at run time ``Runtime.deserialize_cuda_engine`` and named I/O
  tensors (``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``, all 10.0 APIs).
  Device memory is torch's (CUDA tensors): no pycuda / cuda-python.
* fp32: the plain fp32 graphs with ``BuilderFlag.TF32`` cleared (it is on by default and still
  exists in 11; TF32 rounds matmul inputs to 10-bit mantissas, enough to flip a greedy draft).
* fp16 / bf16 on TensorRT 10: weak typing, ``BuilderFlag.FP16`` / ``BF16`` on the fp32 graphs,
  with every RMSNorm layer (by its ONNX node-name scope, which the parser keeps as the layer name)
  and every Softmax pinned to fp32 (``ILayer.precision`` / ``set_output_type`` +
  ``BuilderFlag.OBEY_PRECISION_CONSTRAINTS``). Weak typing was deprecated in 10.12.
* fp16 / bf16 on TensorRT 11 (or ``strongly_typed=True`` / ``--strongly-typed`` on 10): 11 removed
  ``BuilderFlag.FP16`` / ``BF16`` / ``OBEY_PRECISION_CONSTRAINTS`` and every network is strongly
  typed (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``, available since 9.x, is accepted and
  ignored in 11). Precision then comes from the graph: the engines are built from the
  ``<graph>.fp16.onnx`` / ``.bf16.onnx`` variants :func:`dspark.export.export_onnx` writes with
  ``precisions=[...]`` — weights and activations in fp16/bf16, RMSNorm and Softmax in fp32 through
  explicit Casts, fp32 I/O.

Every dynamic axis of every graph gets a min/opt/max from an
:class:`~dspark.export.tensorrt.profile.EngineProfile`; ``block`` is pinned to γ and Eagle3's step
to one new position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark.export.manifest import (
    ExportError,
    graph_entries,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)
from dspark.export.runtime import require_kind
from dspark.export.tensorrt.environment import (
    TensorRTError,
    major_version,
    one_line,
    require_tensorrt,
    trt_logger,
    with_log,
)
from dspark.export.tensorrt.profile import EngineProfile

__all__ = ["build_engines", "uses_strong_typing"]

log = logging.getLogger(__name__)


def uses_strong_typing(trt: Any, profile: EngineProfile) -> bool:
    """Whether :func:`build_engines` builds this profile from the reduced-precision ONNX variants
    as a strongly typed network (fp32 always uses the fp32 graphs)."""
    if profile.precision == "fp32":
        return False
    if profile.strongly_typed is not None:
        return profile.strongly_typed
    return not hasattr(trt.BuilderFlag, profile.precision.upper())  # FP16 / BF16: removed in TensorRT 11


def _pin_fp32(trt: Any, network: Any, scopes: list[str]) -> int:
    """Weak typing (TensorRT 10 + FP16/BF16 flags): pin RMSNorm layers (by node-name scope) and
    Softmax layers to fp32. Returns how many layers were pinned."""
    softmax = getattr(trt.LayerType, "SOFTMAX", None)
    fp32 = trt.DataType.FLOAT
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if not (layer.type == softmax or any(layer.name.startswith(s) for s in scopes)):
            continue
        outs = [j for j in range(layer.num_outputs) if layer.get_output(j).dtype == fp32]
        if not outs:
            continue
        layer.precision = fp32
        for j in outs:
            layer.set_output_type(j, fp32)
        pinned += 1
    return pinned


def _build_one(trt: Any, builder: Any, logger: Any, root: Path, name: str, entry: dict[str, Any],
               fp32_entry: dict[str, Any], manifest: dict[str, Any], profile: EngineProfile,
               strong: bool) -> dict[str, Any]:
    what = f"the {name} engine ({profile.precision}, {'strongly' if strong else 'weakly'} typed)"
    logger.errors.clear()
    flags = 0
    if strong and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(root / entry["file"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or logger.last()
        raise TensorRTError(f"TensorRT {trt.__version__} cannot parse {entry['file']}: {one_line(errors)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(profile.workspace_gib * (1 << 30)))
    record: dict[str, Any] = {"typing": "strong" if strong or major_version(trt.__version__) >= 11 else "weak",
                              "onnx": entry["file"], "precision": profile.precision}
    if profile.precision == "fp32":
        if hasattr(trt.BuilderFlag, "TF32"):  # on by default (TensorRT 8+, still in 11)
            config.clear_flag(trt.BuilderFlag.TF32)
        record["tf32"] = False
    elif not strong:
        flag = getattr(trt.BuilderFlag, profile.precision.upper(), None)
        if flag is None:
            raise TensorRTError(f"TensorRT {trt.__version__} has no BuilderFlag.{profile.precision.upper()} "
                                "(weak typing was removed in TensorRT 11): build strongly typed (--strongly-typed)")
        config.set_flag(flag)
        record["fp32_pinned_layers"] = pinned = _pin_fp32(trt, network, fp32_entry.get("norm_scopes", []))
        if pinned and hasattr(trt.BuilderFlag, "OBEY_PRECISION_CONSTRAINTS"):  # 8.2 … 10.x
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        if fp32_entry.get("norm_scopes") and not any(
                network.get_layer(i).name.startswith(tuple(fp32_entry["norm_scopes"])) for i in range(network.num_layers)):
            log.warning("no TensorRT layer of %s carries an RMSNorm node name; its norms may run in %s and "
                        "overflow on real features", entry["file"], profile.precision)
    sfa = (manifest.get("drafter_config") or {}).get("sample_from_anchor", True)
    axes = profile.axes(name, int(manifest["gamma"]), int(manifest["gamma"]) + (0 if sfa else 1))
    opt_profile = builder.create_optimization_profile()
    shapes: dict[str, list[list[int]]] = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        spec = next((x for x in entry["inputs"] if x["name"] == tensor.name), None)
        if spec is None:
            raise TensorRTError(f"{entry['file']} has an input {tensor.name!r} the manifest does not list; export again")
        mn, opt, mx = ([d if isinstance(d, int) else axes[d][k] for d in spec["shape"]] for k in range(3))
        opt_profile.set_shape(tensor.name, mn, opt, mx)
        shapes[tensor.name] = [mn, opt, mx]
    config.add_optimization_profile(opt_profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise TensorRTError(f"TensorRT {trt.__version__} could not build {what}"
                            + with_log(logger, " (no error was logged)"))
    plan = root / f"{name}.plan"
    with open(plan, "wb") as f:
        f.write(blob)
    return {"file": plan.name, "sha256": sha256_file(plan), "bytes": plan.stat().st_size,
            "axes": {k: list(v) for k, v in axes.items()}, "input_shapes": shapes, **record}


def build_engines(
    out_dir: str | Path,
    profile: EngineProfile | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build one serialized engine (``<graph>.plan``) per exported graph; update the manifest.

    Strongly typed fp16/bf16 builds (TensorRT 11, or ``profile.strongly_typed``) need the
    reduced-precision graphs: ``export_onnx(..., precisions=[precision])``.
    """
    trt = require_tensorrt()
    profile = profile or EngineProfile()
    root = Path(out_dir)
    manifest = read_manifest(root)
    require_kind(manifest)
    strong = uses_strong_typing(trt, profile)
    if strong and profile.precision not in (manifest.get("graph_variants") or {}):
        why = ("TensorRT " + trt.__version__ + f" has no BuilderFlag.{profile.precision.upper()}"
               if profile.strongly_typed is None else "strongly_typed=True")
        raise TensorRTError(
            f"a {profile.precision} engine is built strongly typed here ({why}) from {profile.precision} graphs, "
            f"and {root} has none: export with export_onnx(..., precisions=[{profile.precision!r}]) or run "
            f"python -m dspark.export --drafter CHECKPOINT --out {root} --trt --{profile.precision}")
    entries = graph_entries(manifest, profile.precision if strong else "fp32")
    verify_files(root, entries)
    logger = trt_logger(trt)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:
        raise TensorRTError(f"TensorRT {trt.__version__} cannot create a builder: "
                            f"{one_line(logger.last() or exc)}") from None
    engines: dict[str, Any] = {}
    for name, entry in entries.items():
        if progress:
            progress(f"building {name}.plan ({profile.precision}{', strongly typed' if strong else ''})")
        try:
            engines[name] = _build_one(trt, builder, logger, root, name, entry, manifest["graphs"][name],
                                       manifest, profile, strong)
        except ExportError:
            raise
        except Exception as exc:  # TensorRT's Python bindings raise their own types on API misuse
            raise TensorRTError(f"TensorRT {trt.__version__} failed on the {name} graph: "
                                f"{type(exc).__name__}: {one_line(exc)}" + with_log(logger)) from None
    manifest["engines"] = engines
    manifest["tensorrt"] = {"version": trt.__version__, "profile": profile.to_dict(),
                            "typing": "strong" if strong or major_version(trt.__version__) >= 11 else "weak",
                            "tf32": False if profile.precision == "fp32" else None,
                            "device": torch.cuda.get_device_name()}
    write_manifest(root, manifest)
    return manifest
