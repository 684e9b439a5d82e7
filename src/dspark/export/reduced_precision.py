"""Reduced-precision ONNX variants of the drafter graphs: what a *strongly typed* TensorRT network is
built from (TensorRT 11 has no other way to fp16).

A variant (``<graph>.fp16.onnx``, likewise bf16) is the graph module traced with its weights and
activations in fp16/bf16 behind fp32 I/O (Casts at the inputs and outputs, so the manifest's I/O
tables and the runtime do not change). RMSNorm's mean of squares stays fp32 through the explicit
Casts ``dspark.drafters.layers.RMSNorm`` traces (x.float() … .to(x.dtype)), and every Softmax is
wrapped in Casts to fp32 too: real target features have outliers whose square overflows fp16
(max 65504).

The fp32 graphs record the scopes of their RMSNorm nodes (:func:`norm_scopes`) so that a weakly
typed TensorRT 10 build can pin exactly those layers to fp32.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["REDUCED_PRECISIONS", "ReducedPrecisionGraph", "norm_scopes", "softmax_in_fp32", "variant_file"]

REDUCED_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_ONNX_FLOAT, _ONNX_LOW = 1, {"fp16": 10, "bf16": 16}  # onnx.TensorProto.FLOAT / FLOAT16 / BFLOAT16


class ReducedPrecisionGraph(torch.nn.Module):
    """A graph module run in fp16/bf16 behind fp32 I/O: float inputs are cast down on entry, float
    outputs back up on exit (both traced as Casts). Its RMSNorms compute in fp32 by themselves."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.graph = module.to(dtype)
        self.dtype = dtype

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = tuple(a.to(self.dtype) if a.is_floating_point() else a for a in args)
        outs = self.graph(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(o.float() if o.is_floating_point() else o for o in outs)


def variant_file(graph: str, precision: str) -> str:
    """``<graph>.onnx`` for fp32, ``<graph>.<precision>.onnx`` for a reduced-precision variant."""
    return f"{graph}.onnx" if precision == "fp32" else f"{graph}.{precision}.onnx"


def softmax_in_fp32(model: Any, precision: str) -> int:
    """Wrap every Softmax of a reduced-precision graph whose input is in that precision in Casts:
    fp32 in, its precision out. (torch's exporter already computes a masked attention's softmax in
    fp32 — its mask is fp32 — so this usually finds none; it is there for softmaxes that are not.)
    Types come from ONNX shape inference on the graph without its weights' data."""
    import onnx
    from onnx import helper

    low = _ONNX_LOW[precision]
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is best effort: without types, wrap nothing
        return 0
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    nodes, wrapped = [], 0
    for node in model.graph.node:
        if node.op_type != "Softmax" or types.get(node.input[0]) != low:
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        x32, y32 = f"{x}.fp32_for_{wrapped}", f"{y}.fp32"
        nodes.append(helper.make_node("Cast", [x], [x32], to=_ONNX_FLOAT, name=f"{node.name}/CastToFloat"))
        node.input[0], node.output[0] = x32, y32
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [y32], [y], to=low, name=f"{node.name}/CastBack"))
        wrapped += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return wrapped


def norm_scopes(module: torch.nn.Module, model: Any) -> list[str]:
    """Node-name prefixes ("/layers.0/input_norm/") of the RMSNorm modules in an exported graph.

    The TorchScript exporter names nodes after the path of the modules *called* on the way
    ("/layers.0/input_norm/Pow"; a norm reached through a method of its parent, as the context
    graph's ``layer.context_kv``, is only "/k_norm/Pow_1"), so a scope matches an RMSNorm whose
    qualified name it ends. The TensorRT parser names layers after the nodes, so a weakly typed
    (TensorRT 10 --fp16/--bf16) build can pin exactly these layers to fp32."""
    from dspark.drafters.layers import RMSNorm

    norms = {name for name, m in module.named_modules() if isinstance(m, RMSNorm) and name}
    found = set()
    for node in model.graph.node:
        scope = node.name.rsplit("/", 1)[0]
        path = scope.strip("/").replace("/", ".")
        if path and any(q == path or q.endswith("." + path) for q in norms):
            found.add(scope + "/")
    return sorted(found)
