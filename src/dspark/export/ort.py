"""The ``onnxruntime`` drafter backend: :class:`OrtDrafter`.

    drafter = OrtDrafter.from_dir("out/export")          # checks manifest.json and checksums
    engine = dspark.Engine(target, drafter)               # a dspark.protocols.Drafter like any other

Runs the exported graphs with ONNX Runtime (CPU by default; pass ``providers`` for others) and
keeps the per-request state itself (:mod:`dspark.export.runtime`). ``precision="fp16"`` (or
"bf16") runs the reduced-precision variants an export with ``precisions=[...]`` wrote (the files a
strongly typed TensorRT build parses) — a CPU check of those graphs; ONNX Runtime's CPU provider
has fp16 kernels (or inserts casts around ops that lack them) but no bf16 MatMul.

``onnxruntime-gpu`` (CUDA execution provider) is a different distribution of the same
``onnxruntime`` module: install it *instead of* ``onnxruntime``, never next to it (see
docs/export.md).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.export.manifest import ExportError, graph_entries, read_manifest, verify_files
from dspark.export.runtime import ExportedDrafter, require_kind

__all__ = ["OrtDrafter", "OrtRunner"]

_NP = {"float32": np.float32, "int64": np.int64, "bool": np.bool_}
log = logging.getLogger(__name__)


def ort_distributions() -> list[str]:
    """The installed distributions that provide the ``onnxruntime`` module."""
    found = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


@functools.cache
def _warn_if_both_installed() -> None:
    both = ort_distributions()
    if len(both) > 1:  # the `onnx` and `onnx-gpu` extras together: whichever installed last owns the module
        log.warning("both %s are installed and share one onnxruntime module, so which one runs is whichever "
                    "pip installed last: keep one (pip uninstall onnxruntime, for the CUDA provider)", " and ".join(both))


def _require_ort() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ExportError("the onnxruntime backend needs the onnxruntime package: pip install 'dspark[onnx]'") from None
    _warn_if_both_installed()
    return onnxruntime


class OrtRunner:
    """One ``onnxruntime.InferenceSession`` per graph; torch CPU tensors in and out."""

    device = torch.device("cpu")

    def __init__(self, root: Path, manifest: dict[str, Any], providers: Sequence[str] | None = None,
                 threads: int | None = None, spin: bool = False, precision: str = "fp32") -> None:
        ort = _require_ort()
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        # ORT's worker threads busy-wait after each run by default; between drafter calls the
        # target (torch) runs on the same cores, and spinning workers would steal them.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        opts.log_severity_level = 3  # errors only
        providers = list(providers or ["CPUExecutionProvider"])
        self.sessions: dict[str, Any] = {}
        self.inputs: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, list[str]] = {}
        self.limits: dict[str, dict[str, int]] = {}
        for name, entry in graph_entries(manifest, precision).items():
            try:
                sess = ort.InferenceSession(str(root / entry["file"]), opts, providers=providers)
            except Exception as exc:  # onnxruntime raises its own exception types
                raise ExportError(f"onnxruntime cannot load {root / entry['file']}: {str(exc).splitlines()[0]}") from None
            self.sessions[name] = sess
            self.inputs[name] = {i["name"]: _NP[i["dtype"]] for i in entry["inputs"]}
            self.outputs[name] = [o["name"] for o in entry["outputs"]]

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        want = self.inputs[graph]
        feeds = {k: np.ascontiguousarray(inputs[k].detach().cpu().numpy(), dtype=dt) for k, dt in want.items()}
        outs = self.sessions[graph].run(self.outputs[graph], feeds)
        return {k: torch.from_numpy(v) for k, v in zip(self.outputs[graph], outs)}


class OrtDrafter(ExportedDrafter):
    """A :class:`dspark.protocols.Drafter` running the exported graphs in ONNX Runtime."""

    backend = "onnxruntime"

    @classmethod
    def from_dir(cls, path: str | Path, *, providers: Sequence[str] | None = None,
                 threads: int | None = None, spin: bool = False, verify: bool = True,
                 target: Any = None, precision: str = "fp32") -> OrtDrafter:
        """Load an export folder.

        ``threads``: ORT intra-op threads (default: ORT's choice, one per core); ``spin``: let
        idle ORT workers busy-wait (ORT's default; off here because the target runs on the same
        cores between drafter calls); ``verify``: check every file against the manifest's sha256;
        ``target``: check that its embedding / LM head are the ones baked into the graphs;
        ``precision``: "fp16" / "bf16" run that reduced-precision variant of the graphs.
        """
        root = Path(path)
        manifest = read_manifest(root)
        require_kind(manifest)
        entries = graph_entries(manifest, precision)
        if verify:
            verify_files(root, {**entries, **(manifest.get("scheduling") or {})})
        drafter = cls(manifest, OrtRunner(root, manifest, providers, threads, spin, precision), root)
        if target is not None:
            drafter.check_target(target)
        return drafter
