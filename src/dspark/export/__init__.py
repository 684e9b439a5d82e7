"""ONNX / TensorRT export of neural drafters, and drafters that run the exported graphs.

    python -m dspark.export --drafter CHECKPOINT --out OUT_DIR [--target smollm2-135m] [--validate]
    python -m dspark.export --drafter CHECKPOINT --out OUT_DIR --trt [--fp16 | --bf16] [--batch 1,8,64] ...

    from dspark.export import OrtDrafter
    drafter = OrtDrafter.from_dir(OUT_DIR)     # a dspark.protocols.Drafter

What is exported (details and the I/O tables in docs/export.md): for DSpark / DFlash a
``context`` graph (context features → per-layer injected K/V), a ``backbone`` graph (block
forward with the padded context K/V as explicit inputs → h, base logits) and, for DSpark, a
``head`` graph (one sequential-head step + confidence); for Eagle3 ``fuse``, ``context`` and
``step`` graphs. ``manifest.json`` next to them records shapes, dtypes, opset, versions, the
target and checksums. The heavy modules (onnx, onnxruntime, tensorrt) are imported on first use.
"""

from __future__ import annotations

from typing import Any

from dspark.export.manifest import ExportError, read_manifest

__all__ = [
    "ExportError",
    "OrtDrafter",
    "TensorRTDrafter",
    "build_engines",
    "compare_drafters",
    "export_onnx",
    "read_manifest",
]

_LAZY = {
    "export_onnx": ("dspark.export.exporter", "export_onnx"),
    "OrtDrafter": ("dspark.export.ort", "OrtDrafter"),
    "TensorRTDrafter": ("dspark.export.tensorrt.runtime", "TensorRTDrafter"),
    "build_engines": ("dspark.export.tensorrt.build", "build_engines"),
    "compare_drafters": ("dspark.export.validate", "compare_drafters"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dspark.export' has no attribute {name!r}")
