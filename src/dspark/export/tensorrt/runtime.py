"""Running built engines: :class:`TensorRTRunner` (one deserialized engine and execution context
per graph, CUDA tensors in and out; device memory is torch's, no pycuda / cuda-python) and
:class:`TensorRTDrafter`, the :class:`dspark.protocols.Drafter` on top of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark.export.manifest import ExportError, read_manifest, verify_files
from dspark.export.runtime import ExportedDrafter, require_kind
from dspark.export.tensorrt.environment import (
    TensorRTError,
    one_line,
    require_tensorrt,
    trt_logger,
    with_log,
)

__all__ = ["TensorRTDrafter", "TensorRTRunner"]

_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
           "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


class TensorRTRunner:
    """One deserialized engine + execution context per graph; CUDA tensors in and out."""

    def __init__(self, root: Path, manifest: dict[str, Any], device: str | torch.device = "cuda") -> None:
        trt = require_tensorrt()
        built = (manifest.get("tensorrt") or {}).get("version")
        if built and built != trt.__version__:
            raise TensorRTError(f"the engines in {root} were built by TensorRT {built} and this is TensorRT "
                                f"{trt.__version__}; engines only load in the version that built them: rebuild "
                                f"with python -m dspark.export --drafter CHECKPOINT --out {root} --trt")
        self.device = torch.device(device)
        self._logger = trt_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        dtypes = {getattr(trt.DataType, k): v for k, v in _DTYPES.items() if hasattr(trt.DataType, k)}
        self.engines: dict[str, Any] = {}
        self.limits: dict[str, dict[str, int]] = {}
        self.bounds: dict[str, dict[str, tuple[list[Any], list[int], list[int]]]] = {}
        self.stream = torch.cuda.Stream(self.device)  # also initialises torch's CUDA context first
        graphs = manifest.get("graphs", {})
        with torch.cuda.device(self.device):
            for name, entry in manifest["engines"].items():
                path = root / entry["file"]
                self._logger.errors.clear()
                try:
                    engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
                except Exception as exc:
                    engine, why = None, f"{type(exc).__name__}: {one_line(exc, 160)}"
                else:
                    why = ""
                if engine is None:
                    why = self._logger.last() or why
                    raise TensorRTError(f"TensorRT {trt.__version__} cannot load {path}"
                                        + (f" ({one_line(why, 200)})" if why else "")
                                        + "; built by another TensorRT version or for another GPU? rebuild with --trt")
                names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
                inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
                outputs = [n for n in names if n not in inputs]
                unknown = [n for n in names if engine.get_tensor_dtype(n) not in dtypes]
                if unknown:
                    raise TensorRTError(f"the {name} engine has I/O of a type dspark cannot hold in torch: "
                                        f"{unknown[0]} is {engine.get_tensor_dtype(unknown[0])}")
                context = engine.create_execution_context()
                if context is None:
                    raise TensorRTError(f"TensorRT cannot create an execution context for the {name} engine"
                                        + with_log(self._logger, " (out of GPU memory?)"))
                self.engines[name] = {
                    "engine": engine, "context": context, "inputs": inputs, "outputs": outputs,
                    "dtypes": {n: dtypes[engine.get_tensor_dtype(n)] for n in names},
                }
                self.limits[name] = {k: int(v[2]) for k, v in entry.get("axes", {}).items()}
                specs = {x["name"]: x["shape"] for x in graphs.get(name, {}).get("inputs", [])}
                self.bounds[name] = {n: (specs.get(n, []), s[0], s[2])
                                     for n, s in entry.get("input_shapes", {}).items()}

    def _check_shape(self, graph: str, name: str, shape: tuple[int, ...]) -> None:
        axes, lo, hi = self.bounds.get(graph, {}).get(name, ([], [], []))
        for k, size in enumerate(shape):
            if k < len(lo) and not lo[k] <= size <= hi[k]:
                axis = axes[k] if k < len(axes) else f"dim {k}"
                flag = f"--{axis} MIN,OPT,MAX" if axis in ("batch", "past", "new") else "a larger profile"
                raise TensorRTError(
                    f"the {graph} engine's optimisation profile allows {axis} {lo[k]}..{hi[k]} for {name}, "
                    f"this round needs {size}; rebuild the engines with {flag} covering it")

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        e = self.engines[graph]
        ctx = e["context"]
        keep = []
        for name in e["inputs"]:
            t = inputs[name].to(self.device, e["dtypes"][name]).contiguous()
            keep.append(t)
            self._check_shape(graph, name, tuple(t.shape))
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise TensorRTError(f"the {graph} engine does not accept {name} of shape {tuple(t.shape)} "
                                    "(outside its optimisation profile)" + with_log(self._logger))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in e["outputs"]:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TensorRTError(f"the {graph} engine cannot infer the shape of its output {name} ({shape})"
                                    + with_log(self._logger))
            out = torch.empty(shape, dtype=e["dtypes"][name], device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            outs[name] = out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were written there
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise TensorRTError(f"TensorRT failed to run the {graph} engine" + with_log(self._logger))
        self.stream.synchronize()  # inputs may be freed and outputs read once this returns
        del keep
        return {k: v.float() if v.is_floating_point() else v for k, v in outs.items()}


class TensorRTDrafter(ExportedDrafter):
    """A :class:`dspark.protocols.Drafter` running TensorRT engines built by :func:`build_engines`."""

    backend = "tensorrt"

    @classmethod
    def from_dir(cls, path: str | Path, *, device: str = "cuda", verify: bool = True,
                 target: Any = None) -> TensorRTDrafter:
        root = Path(path)
        manifest = read_manifest(root)
        require_kind(manifest)
        if not manifest.get("engines"):
            raise ExportError(f"{root} has no TensorRT engines; build them with python -m dspark.export --drafter CHECKPOINT --out {root} --trt")
        if verify:
            verify_files(root, {**manifest["engines"], **(manifest.get("scheduling") or {})})
        drafter = cls(manifest, TensorRTRunner(root, manifest, device), root)
        if target is not None:
            drafter.check_target(target)
        return drafter
