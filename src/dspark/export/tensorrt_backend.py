"""The ``tensorrt`` drafter backend: engine builds from the exported ONNX files, and
:class:`TensorRTDrafter`, which runs them.

    python -m dspark.export CHECKPOINT --trt OUT_DIR --fp16 --batch 1,8,64 --past 1,1024,4096
    drafter = TensorRTDrafter.from_dir(OUT_DIR)        # a dspark.protocols.Drafter

TensorRT 10 and 11 (names checked against NVIDIA's Python API reference and the 10.x → 11.x
migration guide; NOT run on a GPU here, see docs/export.md):

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

I/O stays fp32 in every mode, so the runtime is the same for every precision. Every dynamic axis
of every graph gets a min/opt/max from an :class:`EngineProfile`; ``block`` is pinned to γ and
Eagle3's step to one new position.

Failures are one sentence (:class:`TensorRTError`, an :class:`ExportError`): tensorrt missing or
not importable, no CUDA, a builder that cannot start, a parser error, a build that returns
nothing, an engine that does not deserialize (another TensorRT version or GPU), a shape outside
the optimisation profile — with TensorRT's own last logged error where there is one.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from dspark.export.manifest import (
    ExportError,
    graph_entries,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)
from dspark.export.runtime import ExportedDrafter, require_kind

__all__ = ["EngineProfile", "TensorRTError", "load_profile", "tensorrt_missing", "tensorrt_problem",
           "import_tensorrt", "uses_strong_typing", "build_engines", "TensorRTRunner", "TensorRTDrafter"]

MIN_MAJOR = 10


class TensorRTError(ExportError):
    """TensorRT is missing or broken here, or it failed on an export folder (one sentence)."""


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
    """Optimisation-profile ranges (min, opt, max) for the dynamic axes, the precision and typing.

    ``batch``: requests per round; ``past``: padded context length (tokens before the anchor);
    ``new``: context positions ingested in one call (prompt prefill, packed over requests; longer
    ingestions are split into chunks of at most ``new`` max).
    """

    batch: Range = attrs.field(default=(1, 8, 64), converter=_as_range, validator=_range("batch"))
    past: Range = attrs.field(default=(1, 1024, 4096), converter=_as_range, validator=_range("past"))
    new: Range = attrs.field(default=(1, 64, 4096), converter=_as_range, validator=_range("new"))
    precision: str = attrs.field(default="fp32", validator=attrs.validators.in_(PRECISIONS))
    workspace_gib: float = attrs.field(default=4.0)
    # None: strongly typed where the precision's BuilderFlag is gone (TensorRT 11); True forces it
    # (TensorRT 10 has NetworkDefinitionCreationFlag.STRONGLY_TYPED too); False: builder flags.
    strongly_typed: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))

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


#: the presets shipped with the package (``--profile NAME`` picks one by its file name)
PROFILES = Path(__file__).parent / "profiles"


def shipped_profiles() -> list[str]:
    """The names of the shipped presets (``default``, ``interactive-fp16``, ``serving-bf16``)."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load_profile(path: str | Path | None = None, **overrides: Any) -> EngineProfile:
    """An :class:`EngineProfile` from a JSON file, or a shipped preset by name
    (:func:`shipped_profiles`), then ``overrides`` (None values ignored). Unknown keys are an
    error; ``description`` is allowed."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file() and str(path) in shipped_profiles():
            p = PROFILES / f"{path}.json"
        if not p.is_file():
            raise ExportError(f"profile file {p} does not exist (shipped presets: {', '.join(shipped_profiles())})")
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


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return 0


def _cuda_problem() -> str | None:
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # a broken driver / CUDA install can raise here
        return f"torch cannot query CUDA ({type(exc).__name__}: {_one_line(exc, 160)})"
    if available:
        return None
    if not torch.version.cuda:
        return "no CUDA device is visible to torch (this torch is a CPU-only build)"
    return (f"no CUDA device is visible to torch (a CUDA {torch.version.cuda} build: check the driver "
            "with nvidia-smi and CUDA_VISIBLE_DEVICES)")


def import_tensorrt() -> tuple[Any, str | None]:
    """(the tensorrt module or None, what is wrong with it or None). The package is really
    imported: ``importlib.util.find_spec`` finds a wheel whose libraries cannot load."""
    try:
        trt = importlib.import_module("tensorrt")
    except ModuleNotFoundError as exc:
        if exc.name == "tensorrt":
            return None, "the tensorrt Python package is not installed"
        return None, f"the tensorrt package is installed but cannot be imported ({type(exc).__name__}: {_one_line(exc, 160)})"
    except Exception as exc:  # a missing libnvinfer raises OSError / ImportError from inside the package
        return None, f"the tensorrt package is installed but cannot be imported ({type(exc).__name__}: {_one_line(exc, 160)})"
    version = str(getattr(trt, "__version__", "?"))
    if not all(hasattr(trt, a) for a in ("Builder", "OnnxParser", "Runtime", "ILogger")):
        return None, f"the installed tensorrt {version} is not a usable TensorRT (no Builder / OnnxParser / Runtime)"
    if _major(version) < MIN_MAJOR:
        return None, f"the installed TensorRT {version} is too old (dspark needs TensorRT {MIN_MAJOR} or newer)"
    return trt, None


def _logger(trt: Any, echo_warnings: bool = True) -> Any:
    """A ``trt.ILogger`` that prints TensorRT's warnings and keeps its errors for our sentence."""

    class _Recorder(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)  # ILogger.Severity: INTERNAL_ERROR 0, ERROR 1, WARNING 2, INFO 3, VERBOSE 4
            if level <= 1:
                self.errors.append(_one_line(msg, 400))
            elif level == 2 and echo_warnings:
                print(f"[TensorRT] {msg}", file=sys.stderr, flush=True)

        def last(self, n: int = 2) -> str:
            return "; ".join(self.errors[-n:])

    return _Recorder()


def _with_log(logger: Any, fallback: str = "") -> str:
    last = logger.last() if logger is not None else ""
    return f" (TensorRT: {_one_line(last)})" if last else fallback


def tensorrt_problem(probe: bool = False) -> str | None:
    """None when engines can be built and run here, else what is wrong (a sentence fragment).

    Imports tensorrt (a broken install fails here, not 2 minutes later), checks its version and
    that torch sees a CUDA device; ``probe`` also creates a ``trt.Builder``, which initialises CUDA
    inside TensorRT (a wheel built for a newer CUDA than the driver supports fails there)."""
    trt, problem = import_tensorrt()
    problems = [problem] if problem else []
    cuda = _cuda_problem()
    if cuda:
        problems.append(cuda)
    if not problems and probe:
        logger = _logger(trt, echo_warnings=False)
        try:
            builder = trt.Builder(logger)
        except Exception as exc:
            builder, why = None, f"{type(exc).__name__}: {_one_line(exc, 160)}"
        else:
            why = ""
        if builder is None:
            why = logger.last() or why or "no error was logged"
            major = (torch.version.cuda or "12").split(".")[0]
            problems.append(f"TensorRT {trt.__version__} cannot create a builder on this machine ({_one_line(why, 200)}); "
                            f"is the tensorrt wheel built for a CUDA the driver supports? (torch is built for CUDA "
                            f"{torch.version.cuda}: pip install 'tensorrt-cu{major}>=10')")
        del builder
    return " and ".join(problems) or None


def tensorrt_missing() -> str | None:
    """Kept for callers of the first version: :func:`tensorrt_problem` without the builder probe."""
    return tensorrt_problem(probe=False)


def _require_tensorrt() -> Any:
    why = tensorrt_problem()
    if why:
        raise TensorRTError(f"the TensorRT backend cannot run here: {why}")
    trt, _ = import_tensorrt()
    return trt


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
        raise TensorRTError(f"TensorRT {trt.__version__} cannot parse {entry['file']}: {_one_line(errors)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(profile.workspace_gib * (1 << 30)))
    record: dict[str, Any] = {"typing": "strong" if strong or _major(trt.__version__) >= 11 else "weak",
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
            print(f"[dspark] warning: no TensorRT layer of {entry['file']} carries an RMSNorm node name; "
                  f"its norms may run in {profile.precision} and overflow on real features", file=sys.stderr)
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
                            + _with_log(logger, " (no error was logged)"))
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
    trt = _require_tensorrt()
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
            f"python -m dspark.export CHECKPOINT --trt {root} --{profile.precision}")
    entries = graph_entries(manifest, profile.precision if strong else "fp32")
    verify_files(root, entries)
    logger = _logger(trt)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:
        raise TensorRTError(f"TensorRT {trt.__version__} cannot create a builder: "
                            f"{_one_line(logger.last() or exc)}") from None
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
                                f"{type(exc).__name__}: {_one_line(exc)}" + _with_log(logger)) from None
    manifest["engines"] = engines
    manifest["tensorrt"] = {"version": trt.__version__, "profile": profile.to_dict(),
                            "typing": "strong" if strong or _major(trt.__version__) >= 11 else "weak",
                            "tf32": False if profile.precision == "fp32" else None,
                            "device": torch.cuda.get_device_name()}
    write_manifest(root, manifest)
    return manifest


_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
           "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


class TensorRTRunner:
    """One deserialized engine + execution context per graph; CUDA tensors in and out."""

    def __init__(self, root: Path, manifest: dict[str, Any], device: str | torch.device = "cuda") -> None:
        trt = _require_tensorrt()
        built = (manifest.get("tensorrt") or {}).get("version")
        if built and built != trt.__version__:
            raise TensorRTError(f"the engines in {root} were built by TensorRT {built} and this is TensorRT "
                                f"{trt.__version__}; engines only load in the version that built them: rebuild "
                                f"with python -m dspark.export CHECKPOINT --trt {root}")
        self.device = torch.device(device)
        self._logger = _logger(trt)
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
                    engine, why = None, f"{type(exc).__name__}: {_one_line(exc, 160)}"
                else:
                    why = ""
                if engine is None:
                    why = self._logger.last() or why
                    raise TensorRTError(f"TensorRT {trt.__version__} cannot load {path}"
                                        + (f" ({_one_line(why, 200)})" if why else "")
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
                                        + _with_log(self._logger, " (out of GPU memory?)"))
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
                                    "(outside its optimisation profile)" + _with_log(self._logger))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in e["outputs"]:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TensorRTError(f"the {graph} engine cannot infer the shape of its output {name} ({shape})"
                                    + _with_log(self._logger))
            out = torch.empty(shape, dtype=e["dtypes"][name], device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            outs[name] = out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were written there
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise TensorRTError(f"TensorRT failed to run the {graph} engine" + _with_log(self._logger))
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
            verify_files(root, {**manifest["engines"], **(manifest.get("scheduling") or {})})
        drafter = cls(manifest, TensorRTRunner(root, manifest, device), root)
        if target is not None:
            drafter.check_target(target)
        return drafter
