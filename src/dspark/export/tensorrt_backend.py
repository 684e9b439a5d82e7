"""The ``tensorrt`` drafter backend: engine builds from the exported ONNX files, and
:class:`TensorRTDrafter`, which runs them.

    python -m dspark.export CHECKPOINT --trt OUT_DIR --fp16 --batch 1,8,64 --past 1,1024,4096
    drafter = TensorRTDrafter.from_dir(OUT_DIR)        # a dspark.protocols.Drafter

Written against the TensorRT 10 Python API (``Builder.create_network(0)`` = explicit batch,
``OnnxParser.parse_from_file``, one ``IOptimizationProfile`` per engine, named I/O tensors with
``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``). Device memory is torch's
(CUDA tensors), so no pycuda / cuda-python is needed. Every dynamic axis of every graph gets a
min/opt/max from an :class:`EngineProfile`; ``block`` is pinned to γ and Eagle3's step to one
new position. Precision: fp32 (TensorRT's default still lets matmuls use TF32), or ``--fp16`` /
``--bf16`` builder flags (weakly typed: TensorRT may keep layers in fp32); I/O stays fp32, so
the runtime is the same for every precision.

NOT RUN: this module was written without a GPU or TensorRT at hand (see docs/export.md). Its
tests are marked ``gpu`` and skip, with the reason, where CUDA or tensorrt is missing.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from dspark.export.manifest import (
    ExportError,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)
from dspark.export.runtime import ExportedDrafter, require_kind

__all__ = ["EngineProfile", "load_profile", "tensorrt_missing", "build_engines", "TensorRTRunner",
           "TensorRTDrafter"]

Range = tuple[int, int, int]


def _range(name: str) -> Callable[[Any, Any, Any], None]:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if (not isinstance(value, tuple) or len(value) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"{name} must be three integers min,opt,max, got {value!r}")
        lo, opt, hi = value
        if not 1 <= lo <= opt <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= opt <= max, got {lo},{opt},{hi}")
    return check


def _as_range(v: Any) -> Any:
    if isinstance(v, str):
        try:
            v = [int(x) for x in v.split(",")]
        except ValueError:
            return v
    return tuple(v) if isinstance(v, (list, tuple)) else v


PRECISIONS = ("fp32", "fp16", "bf16")


@attrs.frozen
class EngineProfile:
    """Optimisation-profile ranges (min, opt, max) for the dynamic axes, and the precision.

    ``batch``: requests per round; ``past``: padded context length (tokens before the anchor);
    ``new``: context positions ingested in one call (prompt prefill, packed over requests; longer
    ingestions are split into chunks of at most ``new`` max).
    """

    batch: Range = attrs.field(default=(1, 8, 64), converter=_as_range, validator=_range("batch"))
    past: Range = attrs.field(default=(1, 1024, 4096), converter=_as_range, validator=_range("past"))
    new: Range = attrs.field(default=(1, 64, 4096), converter=_as_range, validator=_range("new"))
    precision: str = attrs.field(default="fp32", validator=attrs.validators.in_(PRECISIONS))
    workspace_gib: float = attrs.field(default=4.0)

    def axes(self, graph: str, gamma: int, block: int | None = None) -> dict[str, Range]:
        """Axis name → (min, opt, max) for one graph (graph names are unique across drafter kinds;
        ``block``: the backbone's rows, γ, or γ + 1 in the anchorless z-lab layout)."""
        g = (block or gamma,) * 3
        step_past = (self.past[0], self.past[1] + gamma, self.past[2] + gamma)  # + the γ step slots
        table = {"context": {"new": self.new}, "fuse": {"new": self.new},
                 "backbone": {"batch": self.batch, "block": g, "past": self.past},
                 "head": {"batch": self.batch},
                 "step": {"batch": self.batch, "new": (1, 1, 1), "past": step_past}}
        if graph not in table:
            raise ValueError(f"no TensorRT optimisation profile for a graph named {graph!r}")
        return table[graph]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}


def load_profile(path: str | Path | None = None, **overrides: Any) -> EngineProfile:
    """An :class:`EngineProfile` from a JSON file (see ``export/profiles/``), then ``overrides``
    (None values ignored). Unknown keys are an error; ``description`` is allowed."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ExportError(f"profile file {p} does not exist")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"profile file {p} is not valid JSON ({exc})") from None
        data.pop("description", None)
        unknown = set(data) - {f.name for f in attrs.fields(EngineProfile)}
        if unknown:
            raise ExportError(f"profile file {p} has unknown keys {sorted(unknown)}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EngineProfile(**data)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"bad engine profile: {exc}") from None


def tensorrt_missing() -> str | None:
    """None when engines can be built and run here, else what is missing (a sentence fragment)."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("the tensorrt Python package is not installed")
    if not torch.cuda.is_available():
        missing.append("no CUDA device is visible to torch" + ("" if torch.version.cuda else " (this torch is a CPU-only build)"))
    return " and ".join(missing) or None


def _require_tensorrt() -> Any:
    why = tensorrt_missing()
    if why:
        raise ExportError(f"the TensorRT backend cannot run here: {why}")
    import tensorrt

    return tensorrt


def build_engines(
    out_dir: str | Path,
    profile: EngineProfile | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build one serialized engine (``<graph>.plan``) per exported graph; update the manifest."""
    trt = _require_tensorrt()
    profile = profile or EngineProfile()
    root = Path(out_dir)
    manifest = read_manifest(root)
    require_kind(manifest)
    verify_files(root, manifest["graphs"])
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    engines: dict[str, Any] = {}
    for name, entry in manifest["graphs"].items():
        if progress:
            progress(f"building {name}.plan ({profile.precision})")
        network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(root / entry["file"])):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ExportError(f"TensorRT cannot parse {entry['file']}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(profile.workspace_gib * (1 << 30)))
        if profile.precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif profile.precision == "bf16":
            config.set_flag(trt.BuilderFlag.BF16)
        sfa = (manifest.get("drafter_config") or {}).get("sample_from_anchor", True)
        axes = profile.axes(name, int(manifest["gamma"]), int(manifest["gamma"]) + (0 if sfa else 1))
        opt_profile = builder.create_optimization_profile()
        shapes: dict[str, list[list[int]]] = {}
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            spec = next(x for x in entry["inputs"] if x["name"] == tensor.name)
            mn, opt, mx = ([d if isinstance(d, int) else axes[d][k] for d in spec["shape"]] for k in range(3))
            opt_profile.set_shape(tensor.name, mn, opt, mx)
            shapes[tensor.name] = [mn, opt, mx]
        config.add_optimization_profile(opt_profile)
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise ExportError(f"TensorRT could not build the {name} engine (see its log above)")
        plan = root / f"{name}.plan"
        with open(plan, "wb") as f:
            f.write(blob)
        engines[name] = {"file": plan.name, "sha256": sha256_file(plan), "bytes": plan.stat().st_size,
                         "axes": {k: list(v) for k, v in axes.items()}, "input_shapes": shapes}
    manifest["engines"] = engines
    manifest["tensorrt"] = {"version": trt.__version__, "profile": profile.to_dict(),
                            "device": torch.cuda.get_device_name()}
    write_manifest(root, manifest)
    return manifest


class TensorRTRunner:
    """One deserialized engine + execution context per graph; CUDA tensors in and out."""

    def __init__(self, root: Path, manifest: dict[str, Any], device: str | torch.device = "cuda") -> None:
        trt = _require_tensorrt()
        self.device = torch.device(device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                  trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64,
                  trt.DataType.BOOL: torch.bool, trt.DataType.INT8: torch.int8}
        if hasattr(trt.DataType, "BF16"):
            dtypes[trt.DataType.BF16] = torch.bfloat16
        self.engines: dict[str, Any] = {}
        self.limits: dict[str, dict[str, int]] = {}
        self.stream = torch.cuda.Stream(self.device)  # also initialises torch's CUDA context first
        with torch.cuda.device(self.device):
            for name, entry in manifest["engines"].items():
                engine = self._runtime.deserialize_cuda_engine((root / entry["file"]).read_bytes())
                if engine is None:
                    raise ExportError(f"TensorRT cannot load {root / entry['file']} (built by another "
                                      "TensorRT version or for another GPU? rebuild with --trt)")
                names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
                inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
                outputs = [n for n in names if n not in inputs]
                self.engines[name] = {
                    "engine": engine, "context": engine.create_execution_context(),
                    "inputs": inputs, "outputs": outputs,
                    "dtypes": {n: dtypes[engine.get_tensor_dtype(n)] for n in names},
                }
                self.limits[name] = {k: int(v[2]) for k, v in entry.get("axes", {}).items()}

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        e = self.engines[graph]
        ctx = e["context"]
        keep = []
        for name in e["inputs"]:
            t = inputs[name].to(self.device, e["dtypes"][name]).contiguous()
            keep.append(t)
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ExportError(f"the {graph} engine does not accept {name} of shape {tuple(t.shape)} "
                                  "(outside its optimisation profile)")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in e["outputs"]:
            out = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=e["dtypes"][name], device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            outs[name] = out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were written there
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise ExportError(f"TensorRT failed to run the {graph} engine")
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
            raise ExportError(f"{root} has no TensorRT engines; build them with python -m dspark.export CHECKPOINT --trt {root}")
        if verify:
            verify_files(root, manifest["engines"])
        drafter = cls(manifest, TensorRTRunner(root, manifest, device), root)
        if target is not None:
            drafter.check_target(target)
        return drafter
