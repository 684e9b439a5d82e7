"""``torch.compile`` for :class:`~dspark.fast.llama.LlamaStep`, with a one-sentence failure.

* CPU: inductor with weight freezing — parameters become constants, so the linear weights are
  prepacked for oneDNN / MKL once (AMX or AVX-512 tiles for bf16) and the element-wise ops between
  them fuse into a few C++ loops; the graph's wrapper is C++, not Python (hundreds of tensor
  views and size checks a call, which cost a one-token step milliseconds); and a bf16 graph of one
  to :func:`few_rows` rows (plain decoding, a short verification) runs its products on inductor's
  own C++ GEMM template, untimed (:data:`FEW_ROWS_OPTIONS`), whose micro-kernel streams a weight
  faster than oneDNN there: a step streams each weight from memory once, and then the template's
  few rows cost about what one row costs, while autotuned (:data:`AUTOTUNE_OPTIONS`: inductor
  times each product alone, its weight hot in the cache) these graphs measured slower and varied
  from compile to compile; an fp32 graph of one row autotunes (the template's fp32 lowering has no
  fallback where it does not apply). Past those rows the template falls behind oneDNN's bf16
  kernels (without AMX it computes in fp32), and a graph dynamic in its row count keeps the
  kernels it chose at its first size for every later one, so the caller bounds the few-row
  graph's row count and says which settings a call's graph takes (``graph_options``); the other
  graphs keep oneDNN; and dynamo
  checks no guard on the module's weights before each call (:func:`drop_weight_guards`: frozen,
  they are constants of the graph);
* GPU: ``mode="reduce-overhead"`` — each shape's kernels are captured once as a CUDA graph and
  replayed, removing the per-kernel launch cost that bounds a small model's eager step.

Inductor writes its graphs to its on-disk cache (``TORCHINDUCTOR_CACHE_DIR``), but the frozen CPU
graphs were compiled again by every new process in our runs: count on each start-up compiling.
Compilation happens at the first call of each new shape class; :func:`check_compiler` finds a
missing compiler in seconds beforehand, and :class:`~dspark.fast.FastTarget` falls back to the
packed step, in one logged sentence, if a model's compile fails later.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["AUTOTUNE_OPTIONS", "CPU_OPTIONS", "FEW_ROWS", "FEW_ROWS_OPTIONS", "CompileUnavailable", "check_compiler",
           "FEW_ROWS_AMX", "ROW_AXES", "GraphRows", "compile_step", "drop_weight_guards", "few_rows",
           "first_line", "own_forward", "row_class", "template_rows"]


class CompileUnavailable(RuntimeError):
    """``torch.compile`` cannot run here (no C++ compiler, an unsupported op, ...)."""


_CHECKED: dict[str, str | None] = {}  # device type → None (compiles) or why not


def check_compiler(device: torch.device) -> None:
    """Compile and run a two-op function on ``device`` once per process: a missing C++ compiler
    (CPU) or Triton (GPU) shows here in seconds, as :class:`CompileUnavailable`, instead of
    minutes into a model's compile."""
    key = device.type
    if key not in _CHECKED:
        try:
            fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, dynamic=False)
            fn(torch.ones(8, device=device))
            _CHECKED[key] = None
        except Exception as err:  # inductor's failures have no common base class
            _CHECKED[key] = first_line(err)
    if _CHECKED[key] is not None:
        raise CompileUnavailable(f"torch.compile cannot run on {key} here ({_CHECKED[key]})")


def first_line(err: BaseException) -> str:
    """``TypeName: the first line of its message`` (at most 200 characters of it)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")


def compile_step(step: torch.nn.Module, device: torch.device, *, dynamic: bool | None = None,
                 graph_options: Callable[..., Mapping[str, Any] | None] | None = None) -> Any:
    """``step`` compiled for ``device`` (after :func:`check_compiler`). Graphs are compiled at the
    first call of each new shape class.

    On a CPU the graphs are dynamic in every size from the start (``dynamic=True``): torch
    specialises only sizes 0 and 1, so one graph per class (one row or several × one token or
    several × the past's layout × the capture set) covers every verification.
    On a GPU sizes become symbolic at their second value and each concrete size records its own
    CUDA graph.

    ``graph_options`` (CPU): called with a call's arguments, the inductor settings beyond
    :data:`CPU_OPTIONS` of the graph that call compiles, if it compiles one (None: none);
    :data:`AUTOTUNE_OPTIONS` only for shape classes of fixed sizes, such as torch's size-1
    specialisations, and :data:`FEW_ROWS_OPTIONS` for a bf16 class whose row count is bounded by
    :func:`few_rows` (``torch._dynamo.mark_dynamic(..., max=few_rows())``). Return one of a few
    long-lived mappings, such as these module constants: the config patchers are made once per
    mapping object and kept, so a fresh dict each call would build and keep new ones every call."""
    check_compiler(device)
    # fullgraph: a graph break would otherwise run the whole step eagerly and unpacked, silently
    # (slower than the packed step); as an error it reaches FastTarget's fallback and is said
    if device.type == "cuda":
        return _Patched(torch.compile(step, mode="reduce-overhead", dynamic=dynamic, fullgraph=True), {})
    own = own_forward(step)  # None: a forward that is not a plain function keeps every guard
    guards = {"guard_filter_fn": drop_weight_guards} if own is not None else None
    return _Patched(torch.compile(own or step, dynamic=True if dynamic is None else dynamic, fullgraph=True,
                                  options=guards), CPU_OPTIONS, graph_options)


def own_forward(step: torch.nn.Module) -> Callable[..., Any] | None:
    """``step.forward`` bound to ``step`` on a code object of its own (None where the class's
    forward is not a plain function). dynamo keeps its compiled graphs per code object, so every
    module compiled this way holds only its own graphs: another instance of the same class, whose
    frozen weights differ, can never match one of them, and the guards on the weights (which told
    instances apart) can go (:func:`drop_weight_guards`). The module's forward hooks are not run
    (the compiled modules register none)."""
    fn = type(step).forward
    if not isinstance(fn, types.FunctionType):
        return None
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(own, step)


#: where dynamo's guards on a compiled module's weights and submodules start (guard names are
#: their sources: ``self._modules['layers']._modules['0']._parameters['weight']``, ...)
_WEIGHT_SOURCES = ("self._modules", "self._parameters", "self._buffers")


def drop_weight_guards(entries: Any) -> list[bool]:
    """dynamo's ``guard_filter_fn`` for frozen CPU graphs of :func:`own_forward`: keep a guard
    unless it checks the compiled module's submodules, parameters or buffers, which a frozen graph
    holds as constants anyway (new weights need a new compile: a new compiled step, as
    :class:`~dspark.drafters.loop.TorchRunner` says). The call's inputs and the module's own
    attributes keep theirs, such as FastTarget's capture set (``step.graph_capture``), whose change
    must compile another graph. Nearly all of the target step's guards check its weights, and
    checking them on every call was a visible share of a one-token step
    (docs/reports/2026-12-06-draft-round.md)."""
    return [not entry.name.startswith(_WEIGHT_SOURCES) for entry in entries]


# Graphs one step may need: 1 or several rows × 1 or several tokens × the capture sets a model
# has used × the two past layouts (a request's own cache, the gathered batch): more than dynamo's
# default of 8 recompiles per function, after which fullgraph=True fails.
_RECOMPILE_LIMIT = 64


#: inductor settings of every CPU graph (module docstring)
CPU_OPTIONS: dict[str, Any] = {"freezing": True, "cpp_wrapper": True}

#: and of a graph that autotunes its products: each product's candidates are timed once per shape
#: when the graph compiles (seconds each), and nothing is printed
AUTOTUNE_OPTIONS: dict[str, Any] = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}

#: the most rows (tokens of all requests) of a graph on :data:`FEW_ROWS_OPTIONS` where the template's
#: micro-kernel computes in fp32 (AVX-512 without AMX): up to four its products cost about what one
#: row's cost, past them its fp32 arithmetic, not the weight's bytes, sets the time
#: (docs/reports/2026-12-06-few-rows.md)
FEW_ROWS = 4

#: the same where the micro-kernel runs on AMX tiles (bf16 products summed in fp32, 16 rows a
#: tile): up to 16 rows the template's step measured faster than oneDNN's, at 2 and 8 rows by a
#: fifth (docs/reports/2026-12-07-amx-template.md)
FEW_ROWS_AMX = 16


@functools.cache
def few_rows() -> int:
    """The most rows of a graph on :data:`FEW_ROWS_OPTIONS` on this CPU: :data:`FEW_ROWS_AMX` where
    inductor's instruction set (the one its GEMM template's micro-kernels are chosen for) has AMX
    tiles, else :data:`FEW_ROWS`."""
    try:
        from torch._inductor.cpu_vec_isa import VecAMX, pick_vec_isa

        return FEW_ROWS_AMX if isinstance(pick_vec_isa(), VecAMX) else FEW_ROWS
    except Exception:  # an inductor without these names: the bound measured without AMX
        return FEW_ROWS

#: and of a bf16 graph of one to :func:`few_rows` rows: each product on the C++ GEMM template
#: where it applies, untimed (oneDNN where it does not: inductor's lowering of a packed bf16
#: product keeps it; an fp32 product's lowering has no such fallback, hence bf16 only)
FEW_ROWS_OPTIONS: dict[str, Any] = {**AUTOTUNE_OPTIONS, "max_autotune_gemm_backends": "CPP"}


def template_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether a compiled CPU graph of one request's ``rows`` rows runs its products on the GEMM
    template (:data:`FEW_ROWS_OPTIONS`): in bf16, at most :func:`few_rows` rows."""
    return dtype == torch.bfloat16 and rows <= few_rows()


def row_class(rows: int, dtype: torch.dtype, most: int) -> tuple[int, int]:
    """The row counts [lo, hi] of the graph class of one request's ``rows`` > 1 rows, for
    ``torch._dynamo.mark_dynamic`` (which takes no open range: ``most`` bounds the largest class,
    or ``rows`` where more). A graph dynamic in its row count keeps the kernels it chose at its
    first size, so in bf16 the template's rows (2 … :func:`few_rows`) and oneDNN's (above) compile
    graphs of their own; in fp32 every product is oneDNN's, one class."""
    if template_rows(rows, dtype):
        return 2, few_rows()
    return (few_rows() + 1 if dtype == torch.bfloat16 else 2), max(most, rows)


#: the dynamic axes of a draft graph's inputs (``GraphSpec.dynamic_axes``) that count the token
#: rows its products multiply (``past`` counts the positions attention reads, not rows)
ROW_AXES = ("batch", "new", "block")

#: the largest row count of a draft graph's oneDNN class (mark_dynamic takes no open range): above
#: any round's; a longer context ingest compiles a graph of its own
MOST_ROWS = 1 << 16


class GraphRows:
    """A compiled CPU draft graph's GEMM kernels by call, as the target step's
    (:class:`~dspark.fast.FastTarget`): a call whose ``batch`` axis is 1 (or that has none, such
    as the context call, whose rows are every request's new positions packed) with at most
    :func:`few_rows` rows in bf16 runs its products on the GEMM template, in a graph of its own;
    the rest keep oneDNN. A call's rows: the product of its :data:`ROW_AXES` sizes. ``options`` is
    the call's ``graph_options`` (:func:`compile_step`) and ``mark`` bounds its row axes to the
    class.

    ``spec``: the graph's :class:`~dspark.drafters.graphs.GraphSpec` (its inputs and dynamic axes).
    """

    def __init__(self, spec: Any, dtype: torch.dtype) -> None:
        self.axes = [(name, dim, axis) for name, axes in spec.dynamic_axes.items() if name in spec.inputs
                     for dim, axis in axes.items() if axis in ROW_AXES]  # (input, dim, axis name)
        self.dtype = dtype

    def one_request_rows(self, inputs: Mapping[str, torch.Tensor]) -> int | None:
        """The call's rows where its ``batch`` axis is 1 or absent, else None."""
        sizes = {axis: inputs[name].shape[dim] for name, dim, axis in self.axes if name in inputs}
        return math.prod(sizes.values()) if sizes.get("batch", 1) == 1 else None

    def options(self, **inputs: torch.Tensor) -> Mapping[str, Any] | None:
        rows = self.one_request_rows(inputs)
        return FEW_ROWS_OPTIONS if rows is not None and template_rows(rows, self.dtype) else None

    def mark(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with one request's several-row axes bounded to the row class
        (:func:`row_class`), marked on fresh views: the caller's tensors keep no mark. A graph
        with two row axes beyond ``batch`` bounds each alone (no kind has one)."""
        rows = self.one_request_rows(inputs)
        if rows is None or rows < 2:
            return inputs
        lo, hi = row_class(rows, self.dtype, MOST_ROWS)
        marked = dict(inputs)
        for name, dim, axis in self.axes:
            if axis != "batch" and name in marked and marked[name].shape[dim] > 1:
                if marked[name] is inputs[name]:
                    marked[name] = inputs[name].view(inputs[name].shape)
                torch._dynamo.mark_dynamic(marked[name], dim, min=lo, max=hi)
        return marked


def _setter(config: Any, changes: Mapping[str, Any]) -> Callable[[], Callable[[], None]]:
    """A function that applies ``changes`` to a torch config module and returns the function that
    reverts them: torch's own low-overhead patcher where it has one (a sixth of ``config.patch``'s
    cost, which a compiled graph pays on every call), else ``config.patch``."""
    make = getattr(config, "_make_closure_patcher", None)
    if make is not None:
        return make(**changes)

    def apply() -> Callable[[], None]:
        patch = config.patch(dict(changes))
        patch.__enter__()
        return lambda: patch.__exit__(None, None, None)

    return apply


class _Patched:
    """Calls a compiled step with inductor's ``options`` (:data:`CPU_OPTIONS` on a CPU), those
    ``graph_options`` names for the call, and room for the step's graphs. The settings are read
    when a graph is compiled, which happens at the first call of each new shape class, so every
    call sets them (``torch.compile(options={"freezing": True})`` does not reach the freezing
    pass: dynamo reads the setting while it traces, the weights stay graph inputs and every bf16
    product re-lays its weight out, as in eager)."""

    def __init__(self, fn: Any, options: dict[str, Any],
                 graph_options: Callable[..., Mapping[str, Any] | None] | None = None) -> None:
        self.fn, self.options, self.graph_options = fn, options, graph_options
        self._setters: dict[int, tuple[Mapping[str, Any] | None, tuple]] = {}  # id(extra) → (extra, setters)

    def setters(self, extra: Mapping[str, Any] | None) -> tuple:
        """The config setters of a call whose graph takes ``extra`` settings (made once per mapping)."""
        entry = self._setters.get(id(extra))
        if entry is None or entry[0] is not extra:
            import torch._dynamo.config as dynamo_config
            import torch._inductor.config as inductor_config
            import torch.fx.experimental._config as fx_config

            # use_duck_shape=False: by default two sizes equal at the first call share one symbol,
            # so a past of T = 64 positions next to a head dimension of 64 made T a constant 64,
            # and every longer context compiled another graph
            entry = (extra, (
                _setter(inductor_config, {**self.options, **(extra or {})}),
                _setter(fx_config, {"use_duck_shape": False}),
                _setter(dynamo_config, {"recompile_limit": _RECOMPILE_LIMIT,
                                        "accumulated_recompile_limit": max(_RECOMPILE_LIMIT, 256)}),
            ))
            self._setters[id(extra)] = entry
        return entry[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        extra = self.graph_options(*args, **kwargs) if self.graph_options is not None else None
        reverts = [apply() for apply in self.setters(extra)]
        try:
            if extra is None:
                return self.fn(*args, **kwargs)
            with warnings.catch_warnings():  # inductor's GEMM choice reads a deprecated storage API
                warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
                return self.fn(*args, **kwargs)
        finally:
            for revert in reversed(reverts):
                revert()
