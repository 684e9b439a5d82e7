"""ONNX Runtime for a live PyTorch drafter: :func:`live_ort_runner`, a candidate of the draft-runner race.

The drafter's graphs are exported (:func:`dspark.export.export_onnx`, the same files ``dspark
export`` writes) into a temporary folder, loaded into one ``onnxruntime.InferenceSession`` each
(:class:`~dspark.export.ort.OrtRunner`) and the folder is deleted: the sessions hold the graphs in
memory, so the user exports nothing. The drafter keeps its own drafting loop — its requests'
context caches, its sampling — and only the graph runner changes, as with a compiled runner
(:meth:`dspark.drafters.loop.DraftingLoop.use_runner`).

What the candidate can run is what an export can: a bound fp32 drafter on the CPU. The exported
graphs compute in fp32 with the target's embedding and LM head baked in, so for a bf16 or fp16
drafter they would draft other blocks than the drafter does (and ONNX Runtime's CPU provider has
no bf16 MatMul); those, a drafter on a GPU, a missing onnxruntime and a graph that does not export
raise :class:`OrtUnavailable`, whose message says why in one sentence.

The target's weights and the drafter's are constants of the sessions: after training or a new
target binding, build a new runner.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from dspark.fast.compile import first_line

__all__ = ["LiveOrtRunner", "OrtUnavailable", "check_exportable", "live_ort_runner"]

log = logging.getLogger(__name__)


class OrtUnavailable(RuntimeError):
    """ONNX Runtime cannot run this drafter's graphs here; the message says why in one sentence."""


def check_exportable(drafter: Any) -> None:
    """Raise :class:`OrtUnavailable` for a drafter the ONNX Runtime candidate cannot run here,
    before anything is exported (a dtype, a device, an unbound or non-graph drafter, no onnx)."""
    if not callable(getattr(drafter, "graph_specs", None)) or not callable(getattr(drafter, "loop_spec", None)):
        raise OrtUnavailable(f"{type(drafter).__name__} has no graphs to export")
    if not getattr(drafter, "is_bound", False):
        raise OrtUnavailable("the drafter is not bound to a target, whose weights its graphs bake in")
    param = next(drafter.parameters())
    if param.device.type != "cpu":
        raise OrtUnavailable(f"the drafter is on {param.device.type}, and this candidate runs on onnxruntime's CPU provider")
    if param.dtype != torch.float32:
        dtype = str(param.dtype).removeprefix("torch.")
        why = "onnxruntime's CPU provider has no bfloat16 MatMul, and " if param.dtype == torch.bfloat16 else ""
        raise OrtUnavailable(f"the drafter computes in {dtype}; {why}fp32 graphs would draft other blocks than it does")
    for module, hint in (("onnx", "exporting"), ("onnxruntime", "running the graphs")):
        if importlib.util.find_spec(module) is None:
            raise OrtUnavailable(f"{hint} needs the {module} package (pip install 'dspark[onnx]')")


class LiveOrtRunner:
    """A :class:`~dspark.drafters.loop.GraphRunner` over ONNX Runtime sessions of a live drafter's
    graphs (fp32, CPU). ``path`` is ``onnxruntime``; a graph call that ONNX Runtime fails (a shape
    its kernels reject, say) is run again on the drafter's own modules, and from then on every
    call is (``path`` becomes ``eager``), with one logged sentence: the graphs are pure functions
    of their inputs, so the rerun gives the call's result."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, drafter: Any, sessions: Any) -> None:
        self.drafter = drafter
        self.sessions = sessions  # a dspark.export.ort.OrtRunner
        self.limits: dict[str, dict[str, int]] = {}
        self._eager: Any = None

    @property
    def path(self) -> str:
        """``onnxruntime``, or ``eager`` after a failed call sent the drafter to its own modules."""
        return "onnxruntime" if self._eager is None else "eager"

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._eager is not None:
            return self._eager.run(graph, inputs)
        try:
            return self.sessions.run(graph, inputs)
        except Exception as err:  # onnxruntime raises its own exception types
            from dspark.drafters.loop import TorchRunner

            log.warning("onnxruntime draft graph %r failed (%s); the drafter runs eager from here", graph,
                        first_line(err))
            self._eager = TorchRunner(self.drafter)
            return self._eager.run(graph, inputs)


def live_ort_runner(drafter: Any, threads: int | None = None) -> LiveOrtRunner:
    """ONNX Runtime sessions of ``drafter``'s graphs, exported to a temporary folder that is gone
    when this returns. ``threads``: onnxruntime's intra-op threads (None: one per core). Raises
    :class:`OrtUnavailable` (one sentence) where the drafter cannot run there; the drafter itself
    is left as it was (its training mode included)."""
    check_exportable(drafter)
    from dspark.export import ExportError, export_onnx
    from dspark.export.ort import OrtRunner

    training = drafter.training
    try:
        with tempfile.TemporaryDirectory(prefix="dspark-live-onnx-", ignore_cleanup_errors=True) as folder:
            manifest = export_onnx(drafter, folder)
            # the sessions read every file while they are built (external weights included)
            sessions = OrtRunner(Path(folder), manifest, threads=threads)
    except ExportError as err:
        raise OrtUnavailable(str(err)) from None
    except Exception as err:  # the TorchScript exporter and onnx.checker have no common base class
        raise OrtUnavailable(f"its graphs did not export to ONNX ({first_line(err)})") from None
    finally:
        drafter.train(training)
    return LiveOrtRunner(drafter, sessions)
