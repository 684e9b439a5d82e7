"""One drafting loop for every runner: PyTorch modules, ONNX Runtime sessions, TensorRT engines.

A neural drafter computes in a handful of *graphs* (:mod:`dspark.drafters.graphs`: ``context``,
``backbone``, ``head`` for DSpark / DFlash; ``fuse``, ``context``, ``step`` for Eagle3). A
:class:`GraphRunner` runs one graph by name on named tensors; everything else — the per-request
context K/V, padding, the pending Eagle3 feature, the sequential-head steps, sampling — is done
here, once, for all runners. The PyTorch drafters run their own modules through
:class:`TorchRunner`; the exported drafters run ONNX / TensorRT files through theirs, so the tests
of one path cover the logic of the other and only the thin runner differs.

Terms: R requests, γ block size, V vocabulary (V_d with a reduced draft vocabulary), d hidden size,
L draft layers whose context K/V are cached, H_kv key/value heads, hd head dim, P padded context.

* per request, the context K/V of every draft layer ``[L, H_kv, capacity, hd]`` (:class:`KVStore`,
  grown by doubling instead of concatenated every round);
* per round, the new context positions of *all* requests are packed into one ``context`` call
  (KV injection is per position), then the caches are right-padded into
  ``ctx_k/ctx_v [L, R, H_kv, P, hd]`` + ``ctx_mask [R, P]`` (P ≥ 1: an empty context is one masked slot);
* the sequential head is stepped γ times (j = 1..γ, x̂_0 the anchor), and every x̂_j is drawn with
  :mod:`dspark.sampling` under the request's SamplingParams and generator;
* Eagle3: the fused feature of the last context position waits ("pending") for its next token; the
  K/V of a causal layer's context position need no past, so context ingestion is packed too; the γ
  steps write their K/V into preallocated slots after the padded context, masked until written.

A drafter kind chooses its round function (:data:`RoundFn`): DSpark's
:func:`dspark.drafters.dspark.round.dspark_round`, DFlash's
:func:`dspark.drafters.dflash.round.block_round`, Eagle3's
:func:`dspark.drafters.eagle3.round.autoregressive_round`; :mod:`dspark.drafters.draws` holds the
draws every round makes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from dspark.drafters.draws import draft_lengths, draft_sample, target_features
from dspark.drafters.vocab import DraftVocab, to_target_space
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["GraphRunner", "TorchRunner", "GraphCalls", "LoopSpec", "KVStore", "DraftingLoop", "RoundFn"]

log = logging.getLogger(__name__)


@runtime_checkable
class GraphRunner(Protocol):
    """Runs one drafter graph. Inputs are CPU or ``device`` tensors; outputs are on ``device``."""

    device: torch.device
    limits: dict[str, dict[str, int]]  # graph → axis name → largest size it accepts ({} = any)

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class TorchRunner:
    """Runs a PyTorch drafter's own modules as the graphs (no copy of any weight).

    The graph modules read the drafter's bound target embedding / LM head and mask vector at call
    time, so training, ``bind_target`` and dtype changes are seen by the next round.

    ``compiled``: the graphs run through ``torch.compile`` (:func:`dspark.fast.compile.compile_step`:
    inductor with weight freezing on a CPU, CUDA graphs on a GPU), compiled at their first call of
    each shape class — on a CPU all but :attr:`EAGER_ON_CPU`. Frozen weights are constants of the
    compiled graphs, so a compiled runner is for inference: after the weights change, build a new
    runner (:meth:`DraftingLoop.use_runner`).
    """

    limits: dict[str, dict[str, int]] = {}
    #: graphs a compiled runner leaves eager on a CPU: the sequential-head step is one gather and two
    #: small products, which a compiled call does not speed up but adds its own call cost to
    #: (and the cached-rows step compares data pointers, which dynamo cannot trace); on a GPU every
    #: graph is captured (launches bound it)
    EAGER_ON_CPU: tuple[str, ...] = ("head",)

    def __init__(self, drafter: Any, compiled: bool = False) -> None:
        self.drafter = drafter
        self.compiled = compiled
        self._graphs: dict[str, tuple[Any, tuple[str, ...]]] | None = None

    @property
    def path(self) -> str:
        """``compiled`` or ``eager`` (the modules as they are, prepacked products where they pack)."""
        return "compiled" if self.compiled else "eager"

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.drafter.parameters()).dtype

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._graphs is None:
            self._graphs = {g.name: (*self._wrap(g), g.outputs)
                            for g in self.drafter.graph_specs(self.drafter, live=True)}
        module, rows, outputs = self._graphs[graph]
        dev = self.device  # the loop builds small index tensors on the CPU; the modules may be on CUDA
        inputs = {k: v.to(dev, non_blocking=True) for k, v in inputs.items()}
        try:
            out = module(**(rows.mark(inputs) if rows is not None else inputs))
        except Exception as err:
            if not self.compiled:
                raise
            # a shape class that fails to compile: the graphs are pure, so rerun this call eager
            from dspark.fast.compile import first_line

            log.warning("compiled draft graph %r failed (%s); the drafter runs eager from here", graph,
                        first_line(err))
            self.compiled, self._graphs = False, None
            return self.run(graph, inputs)
        out = out if isinstance(out, tuple) else (out,)
        if self.compiled and dev.type == "cuda":  # CUDA-graph outputs are overwritten by the next replay
            out = tuple(o.clone() for o in out)
        return dict(zip(outputs, out))

    def _wrap(self, spec: Any) -> tuple[Any, Any]:
        """The callable that runs graph ``spec`` and, compiled on a CPU, its
        :class:`~dspark.fast.compile.GraphRows` (which GEMM kernels a call's graph takes)."""
        if not self.compiled or (self.device.type == "cpu" and spec.name in self.EAGER_ON_CPU):
            return spec.module, None
        from dspark.fast.compile import GraphRows, compile_step

        if self.device.type != "cpu":
            return compile_step(spec.module, self.device), None

        rows = GraphRows(spec, self.dtype)
        return compile_step(spec.module, self.device, graph_options=rows.options), rows


class GraphCalls:
    """A runner's graph calls while inside ``with GraphCalls(runner) as calls:``, as benchmarks
    watch a real round: the seconds of each call by graph (``seconds[graph]``) and, with
    ``keep_inputs``, the last inputs of each graph, cloned (``inputs[graph]``: what a benchmark
    replays). The runner's own ``run`` is back on exit."""

    def __init__(self, runner: GraphRunner, keep_inputs: bool = False) -> None:
        self.runner = runner
        self.keep_inputs = keep_inputs
        self.seconds: dict[str, list[float]] = {}
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}

    def count(self, graph: str) -> int:
        """Calls of ``graph`` so far."""
        return len(self.seconds.get(graph, ()))

    def clear(self) -> None:
        self.seconds.clear()
        self.inputs.clear()

    def __enter__(self) -> GraphCalls:
        inner = self.runner.run

        def run(graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if self.keep_inputs:
                self.inputs[graph] = {k: v.clone() for k, v in inputs.items()}
            t0 = time.perf_counter()
            out = inner(graph, inputs)
            self.seconds.setdefault(graph, []).append(time.perf_counter() - t0)
            return out

        self._own = vars(self.runner).get("run")  # a run of the instance's own (another watch), or None
        self.runner.run = run  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self.runner.run = self._own
        else:
            del self.runner.run


@attrs.frozen
class LoopSpec:
    """What the loop needs to know about a drafter: from its config or an export manifest."""

    kind: str
    gamma: int
    vocab_size: int
    hidden_size: int
    target_layer_ids: tuple[int, ...]
    num_layers: int  # layers whose context K/V are cached (1 for Eagle3)
    num_kv_heads: int
    head_dim: int
    head: str | None = None  # the sequential head (DSpark), None for DFlash / Eagle3
    rank: int = 0
    confidence: bool = False
    stateful_head: bool = False  # the head carries a state [R, r] between steps (RNN head)
    sample_from_anchor: bool = True  # False: z-lab DFlash, the anchor row predicts nothing
    returns_hidden: bool = True  # DraftBlock.hidden carries h (block) / the step outputs (Eagle3)
    vocab_map: DraftVocab | None = attrs.field(default=None, eq=False)

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


class KVStore:
    """One request's context K/V: [L, H_kv, capacity, hd] each, valid up to ``length``; entry i
    holds absolute position ``offset`` + i (``offset`` > 0 after a restart at a feature gap)."""

    __slots__ = ("k", "v", "length", "offset")

    def __init__(self, offset: int = 0) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.offset = offset

    @property
    def end(self) -> int:
        """The absolute position the next appended entry takes."""
        return self.offset + self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # [L, H_kv, n, hd]
        n = k.shape[2]
        if n == 0:
            return
        need = self.length + n
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (self.k.shape[2] if self.k is not None else 0), 16)
            shape = (k.shape[0], k.shape[1], cap, k.shape[3])
            grown_k, grown_v = k.new_zeros(shape), v.new_zeros(shape)
            if self.k is not None and self.length:
                grown_k[:, :, : self.length] = self.k[:, :, : self.length]
                grown_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v
        self.length = need


#: one round of drafting: (loop, context, each request's new target features [n_new, m·d]) → the block
RoundFn = Callable[["DraftingLoop", DraftContext, list[torch.Tensor]], DraftBlock]


class DraftingLoop:
    """Per-request state and one round of drafting over a :class:`GraphRunner`."""

    def __init__(self, spec: LoopSpec, runner: GraphRunner, round_fn: RoundFn) -> None:
        self.spec = spec
        self.runner = runner
        self.round_fn = round_fn
        self.caches: dict[str, KVStore] = {}
        self.pending: dict[str, torch.Tensor | None] = {}  # Eagle3: fused feature of the last context position
        self.timings: dict[str, float] = {}  # seconds per part of the last round
        self._scratch: list[torch.Tensor] = []  # flat K and V buffers that gather() reuses
        #: opt-in "survival floor" variant of a head with a confidence head: a request's draft ends at
        #: the first position whose survival Π σ(confidence logit) falls below it (valid lengths cut
        #: there), and the head stops stepping once every request's has (dspark.drafters.dspark.round)
        self.survival_floor: float | None = None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype the runner's graphs take (fp32 for exported files)."""
        return getattr(self.runner, "dtype", torch.float32)

    def use_runner(self, runner: GraphRunner) -> None:
        """Run the next rounds' graphs on ``runner`` (e.g. a compiled :class:`TorchRunner`); the
        requests' context caches stay (every runner of one drafter computes the same K/V)."""
        self.runner = runner
        self._scratch = []

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        self.pending.pop(request_id, None)

    def cache_for(self, request_id: str, start: int | None) -> KVStore:
        """The request's context cache, restarted at ``start`` when its new features begin after
        a gap (the engine captured no target features for a while): the drafter then attends to
        the context from ``start`` on. Lossless either way; only the drafts' quality changes."""
        cache = self.caches.get(request_id)
        # Eagle3 keeps the last context feature pending (it pairs with the next anchor), so its next
        # new feature is one past the cache's end.
        expected = None if cache is None else cache.end + (self.pending.get(request_id) is not None)
        if cache is None or (start is not None and start > expected):
            cache = self.caches[request_id] = KVStore(offset=0 if start is None else start)
            self.pending[request_id] = None
        elif start is not None and start < expected:
            raise ValueError(
                f"request {request_id!r}: new features start at position {start} but the drafter "
                f"already holds context up to position {expected - 1}")
        return cache

    @torch.inference_mode()
    def draft(self, context: DraftContext) -> DraftBlock:
        s = self.spec
        feats = target_features(context, s.kind, s.target_layer_ids, s.hidden_size)
        dev = self.device
        feats = [f if f.device == dev and f.dtype == torch.float32 else f.to(dev, torch.float32) for f in feats]
        return self.round_fn(self, context, feats)

    # -- helpers for the round functions ---------------------------------------------------------
    @staticmethod
    def check_anchor(rid: str, cache: KVStore, ids: torch.Tensor, lag: int) -> None:
        if cache.end != ids.numel() - lag:
            raise ValueError(
                f"request {rid!r}: the drafter has context up to position {cache.end} but the "
                f"anchor is at position {ids.numel() - 1}; pass the target features of every "
                "committed token before the anchor"
            )

    def limit(self, graph: str, axis: str) -> int | None:
        return self.runner.limits.get(graph, {}).get(axis)

    def check_limit(self, graph: str, axis: str, size: int) -> None:
        top = self.limit(graph, axis)
        if top is not None and size > top:
            raise ValueError(
                f"{graph} graph: {axis} = {size} exceeds the engine's optimisation profile (max {top}); "
                f"rebuild the engines with a larger --{axis} range"
            )

    def gather(self, caches: list[KVStore], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad the caches → K, V [L, R, H_kv, P + extra, hd], mask [R, P + extra] (P ≥ 1 − extra)."""
        s, R = self.spec, len(caches)
        P = max([c.length for c in caches] + [0])
        P = max(P, 1 - extra)
        shape = (s.num_layers, R, s.num_kv_heads, P + extra, s.head_dim)
        K, Vv = self._buffers(shape)
        mask = torch.zeros(R, P + extra, dtype=torch.bool, device=self.device)
        for r, c in enumerate(caches):
            if c.length:
                K[:, r, :, : c.length] = c.k[:, :, : c.length]
                Vv[:, r, :, : c.length] = c.v[:, :, : c.length]
                mask[r, : c.length] = True
        return K, Vv, mask

    def _buffers(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two zeroed contiguous tensors of ``shape`` over buffers kept between rounds: the padded
        K/V of a large batch are re-used instead of allocated (and page-faulted) every round.
        Zeroed because a masked slot's value is multiplied by an attention weight of 0, and
        0 · (stale NaN/inf) would not be 0."""
        n = 1
        for x in shape:
            n *= x
        dev, dtype = self.device, self.dtype
        if not self._scratch or self._scratch[0].numel() < n or self._scratch[0].dtype != dtype \
                or self._scratch[0].device != dev \
                or self._scratch[0].is_inference() != torch.is_inference_mode_enabled():
            self._scratch = [torch.empty(n, device=dev, dtype=dtype) for _ in range(2)]
        return tuple(b[:n].view(shape).zero_() for b in self._scratch)  # type: ignore[return-value]

    def sample(self, logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, ...]:
        """Draft-space logits [R, V_d] (any device) → (slots [R], tokens [R], q [R, V], logits [R, V])
        on the CPU."""
        U = logits.float().cpu()
        q, x = draft_sample(U, context)
        return (x, *to_target_space(self.spec.vocab_map, x, q, U))

    def valid(self, context: DraftContext, R: int) -> torch.Tensor:
        return draft_lengths(context, R, self.spec.gamma)

    def run_packed(self, graph: str, inputs: dict[str, torch.Tensor], axis_dim: dict[str, int],
                   outputs: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run a per-position graph over N packed positions, in chunks the runner accepts."""
        first = next(iter(inputs))
        n = inputs[first].shape[axis_dim[first]]
        step = self.limit(graph, "new") or n
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in outputs}
        for s in range(0, n, step):
            chunk = {k: v.narrow(axis_dim[k], s, min(step, n - s)) for k, v in inputs.items()}
            out = self.runner.run(graph, chunk)
            for k in outputs:
                parts[k].append(out[k])
        return {k: torch.cat(v, dim=outputs[k]) if len(v) > 1 else v[0] for k, v in parts.items()}
