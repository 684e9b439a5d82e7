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

A drafter kind chooses its round function (:func:`block_round` or :func:`autoregressive_round`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from dspark.drafters.vocab import DraftVocab, to_slots, to_target_space
from dspark.protocols.drafter import DraftContext
from dspark.sampling import probs_for_requests, sample
from dspark.types import DraftBlock

__all__ = ["GraphRunner", "TorchRunner", "LoopSpec", "KVStore", "DraftingLoop", "block_round",
           "autoregressive_round", "backbone", "target_features", "draft_sample", "draft_lengths"]

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
    #: (scripts/draft_graphs.py times both); on a GPU every graph is captured (launches bound it)
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
            self._graphs = {g.name: (self._wrap(g.name, g.module), g.outputs)
                            for g in self.drafter.graph_specs(self.drafter, live=True)}
        module, outputs = self._graphs[graph]
        dev = self.device  # the loop builds small index tensors on the CPU; the modules may be on CUDA
        try:
            out = module(**{k: v.to(dev, non_blocking=True) for k, v in inputs.items()})
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

    def _wrap(self, name: str, module: torch.nn.Module) -> Any:
        if not self.compiled or (self.device.type == "cpu" and name in self.EAGER_ON_CPU):
            return module
        from dspark.fast.compile import compile_step

        return compile_step(module, self.device)


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


def target_features(
    context: DraftContext, drafter: str, layer_ids: tuple[int, ...], hidden_size: int
) -> list[torch.Tensor]:
    """The new target features of each request, checked: R × [n_new, m·d]."""
    feats = context.features.get("hidden")
    R = len(context.request_ids)
    if feats is None or len(feats) != R:
        raise ValueError(
            f"{drafter} drafter needs features['hidden']: one [n_new, m·d] tensor per request "
            f"(target hidden states at layers {list(layer_ids)})"
        )
    want = len(layer_ids) * hidden_size
    for rid, f in zip(context.request_ids, feats):
        if f.ndim != 2 or f.shape[1] != want:
            raise ValueError(
                f"request {rid!r}: features must be [n_new, {want}] (m={len(layer_ids)} "
                f"layers × hidden {hidden_size}), got {tuple(f.shape)}"
            )
    return feats


def feature_starts(context: DraftContext) -> list[int | None]:
    """``features["hidden_start"]``: the absolute position of each request's first new feature row
    (None or absent: right after what the drafter holds). A start beyond the drafter's context
    restarts it there (:meth:`DraftingLoop.cache_for`)."""
    starts = context.features.get("hidden_start")
    if starts is None:
        return [None] * len(context.request_ids)
    if len(starts) != len(context.request_ids):
        raise ValueError(f"features['hidden_start'] holds {len(starts)} positions for "
                         f"{len(context.request_ids)} requests")
    return [None if s is None else int(s) for s in starts]


def draft_sample(logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] → (q [R, V], tokens [R]) under each request's sampling params.

    q is the distribution each token was drawn from (what verification needs). An all-greedy batch
    takes the argmax with a one-hot q, skipping the softmax and the V exponential draws per row.
    """
    if all(p.is_greedy for p in context.sampling):
        tokens = logits.float().argmax(-1)  # [R]
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, tokens[:, None], 1.0), tokens
    q = probs_for_requests(logits, context.sampling)  # [R, V]
    return q, sample(q, context.generators)


def draft_lengths(context: DraftContext, R: int, gamma: int) -> torch.Tensor:
    """Valid draft lengths [R]: γ, cut to the room the engine left each request."""
    valid = torch.full((R,), gamma, dtype=torch.long)
    if context.max_lengths is not None:
        valid = torch.minimum(valid, context.max_lengths.long().clamp_min(0))
    return valid  # [R]


RoundFn = Callable[["DraftingLoop", DraftContext, list[torch.Tensor]], DraftBlock]


class _Draws:
    """The γ draws of one round. An all-greedy batch takes each argmax where the logits are (the
    runner's device) and brings the round's logits to the CPU once, at the end; a sampled batch
    draws on the CPU step by step, with the requests' own generators."""

    def __init__(self, loop: DraftingLoop, context: DraftContext) -> None:
        self.loop, self.context = loop, context
        self.greedy = all(p.is_greedy for p in context.sampling)
        self.slots: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def draw(self, U_j: torch.Tensor) -> torch.Tensor:
        """Draft-space logits [R, V_d] → the drawn slots [R] (the next step's input)."""
        if self.greedy:
            slot = U_j.float().argmax(-1)  # [R] on the runner's device
            self.slots.append(slot)
            self.logits.append(U_j)
            return slot
        slot, x, q, U = self.loop.sample(U_j, self.context)
        self.tokens.append(x)
        self.qs.append(q)
        self.logits.append(U)
        return slot

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [R, γ], q [R, γ, V], logits [R, γ, V]) in target space, on the CPU."""
        if not self.greedy:
            return torch.stack(self.tokens, 1), torch.stack(self.qs, 1), torch.stack(self.logits, 1)
        U = torch.stack(self.logits, 1).float().cpu()  # [R, γ, V_d] one transfer per round
        slots = torch.stack(self.slots, 1).cpu()  # [R, γ]
        q = torch.zeros_like(U).scatter_(-1, slots[..., None], 1.0)  # one-hot: what was "sampled"
        return to_target_space(self.loop.spec.vocab_map, slots, q, U)


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


def block_round(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
    """DSpark / DFlash: ingest new context, one parallel backbone call, γ sequential-head steps.

    x̂_j ~ softmax(Ũ_j) with Ũ_j = U_j + b(x̂_{j−1}, h_j) (DSpark; U_j alone for DFlash), and the
    confidence logit of step j read from (h_j, x̂_{j−1}).
    """
    s = loop.spec
    R = len(context.request_ids)
    loop.check_limit("backbone", "batch", R)
    caches, chunks, positions, owners = [], [], [], []
    for rid, f, start in zip(context.request_ids, feats, feature_starts(context)):
        cache = loop.cache_for(rid, start)
        caches.append(cache)
        if f.shape[0]:
            chunks.append(f)
            positions.append(torch.arange(cache.end, cache.end + f.shape[0]))
            owners.append((cache, f.shape[0]))
    t0 = time.perf_counter()
    if chunks:
        out = loop.run_packed(
            "context", {"features": torch.cat(chunks), "positions": torch.cat(positions)},
            {"features": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
        k, v, off = out["ctx_k"], out["ctx_v"], 0  # [L, H_kv, N, hd]
        for cache, n in owners:
            cache.append(k[:, :, off : off + n], v[:, :, off : off + n])
            off += n
    t_ingest = time.perf_counter() - t0
    for rid, ids, cache in zip(context.request_ids, context.token_ids, caches):
        loop.check_anchor(rid, cache, ids, lag=1)
    anchors = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R]
    t0 = time.perf_counter()
    h, U = backbone(loop, anchors, torch.tensor([ids.numel() - 1 for ids in context.token_ids]), caches)
    t_head = 0.0
    draws, conf = _Draws(loop, context), []
    prev = to_slots(s.vocab_map, anchors)  # x̂_0 = the anchor, as a draft slot
    state = torch.zeros(R, s.rank, device=loop.device, dtype=h.dtype) if s.stateful_head else None
    for j in range(s.gamma):
        U_j = U[:, j].float()  # [R, V_d]
        if s.head is not None:
            t1 = time.perf_counter()
            inputs = {"prev_ids": prev.to(loop.device), "h_j": h[:, j].contiguous(), "base_logits_j": U_j.contiguous()}
            if state is not None:
                inputs["state"] = state
            step = loop.runner.run("head", inputs)
            U_j = step["logits"]
            if s.confidence:
                conf.append(step["confidence_logit"])  # [R], brought to the CPU with the round
            if state is not None:
                state = step["state_out"]
            t_head += time.perf_counter() - t1
        prev = draws.draw(U_j)
    tokens, q, logits = draws.finish()  # [R, γ], [R, γ, V], [R, γ, V]
    loop.timings = {"draft": time.perf_counter() - t0, "sequential_head": t_head, "ingest": t_ingest}
    return DraftBlock(
        tokens=tokens, q=q, valid_lengths=loop.valid(context, R),
        confidence_logits=torch.stack(conf, 1).float().cpu() if conf else None,  # [R, γ]
        draft_logits=logits,
        hidden=h.cpu() if s.returns_hidden else None,  # [R, γ, d]
    )


def backbone(loop: DraftingLoop, anchors: torch.Tensor, anchor_pos: torch.Tensor,
             caches: list[KVStore]) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [R], anchor_pos [R] over the cached contexts → h [R, γ, d], base logits U [R, γ, V_d]."""
    s = loop.spec
    skip = 0 if s.sample_from_anchor else 1  # z-lab DFlash: the anchor row predicts nothing
    ctx_k, ctx_v, mask = loop.gather(caches)
    loop.check_limit("backbone", "past", mask.shape[1])
    out = loop.runner.run("backbone", {
        "anchor_ids": anchors, "positions": anchor_pos[:, None] + torch.arange(s.gamma + skip)[None],
        "ctx_k": ctx_k, "ctx_v": ctx_v, "ctx_mask": mask})
    return out["h"][:, skip:], out["base_logits"][:, skip:]  # [R, γ, d], [R, γ, V_d]


def autoregressive_round(loop: DraftingLoop, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
    """Eagle3: fuse and cache new context positions, then γ causal steps of one layer.

    The layer at position t reads (x_{t+1}, h_t): h_t the fused feature f_t of a context position
    or the previous step's output; the last context feature (t = a − 1, paired with the anchor) is
    the first drafting step, so it stays pending until the round that drafts from it.
    """
    s = loop.spec
    R, d = len(context.request_ids), s.hidden_size
    loop.check_limit("step", "batch", R)
    t0 = time.perf_counter()
    sizes = [f.shape[0] for f in feats]
    fused_all = None
    if sum(sizes):
        fused_all = loop.run_packed("fuse", {"features": torch.cat(feats)}, {"features": 0}, {"fused": 0})["fused"]
    caches, last_feat, off = [], [], 0
    toks, ready, positions, owners = [], [], [], []
    for rid, ids, n, start in zip(context.request_ids, context.token_ids, sizes, feature_starts(context)):
        cache = loop.cache_for(rid, start)
        caches.append(cache)
        fused = fused_all[off : off + n] if n else None
        off += n
        pending = loop.pending.get(rid)
        if pending is not None:
            fused = pending if fused is None else torch.cat([pending, fused])
        if fused is None or fused.shape[0] == 0:
            # A one-token prompt has no target feature yet: draft from a zero feature once, and do
            # not cache it (position −1 does not exist).
            last_feat.append(None)
            loop.pending[rid] = None
            owners.append((rid, ids, cache, 0, None))
            continue
        # Positions t with both f_t and x_{t+1} committed go into the cache.
        n_ready = fused.shape[0] - 1
        if n_ready > 0:
            at = cache.end
            toks.append(ids[at + 1 : at + 1 + n_ready].long())
            ready.append(fused[:n_ready])
            positions.append(torch.arange(at, at + n_ready))
        loop.pending[rid] = fused[-1:]
        last_feat.append(fused[-1])
        owners.append((rid, ids, cache, n_ready, fused))
    if toks:
        out = loop.run_packed(
            "context", {"token_ids": torch.cat(toks), "feats": torch.cat(ready), "positions": torch.cat(positions)},
            {"token_ids": 0, "feats": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
        k, v, off = out["ctx_k"], out["ctx_v"], 0  # [1, H_kv, N, hd]
        for _rid, _ids, cache, n_ready, _f in owners:
            if n_ready:
                cache.append(k[:, :, off : off + n_ready], v[:, :, off : off + n_ready])
                off += n_ready
    for rid, ids, cache, _n, fused in owners:
        if fused is not None:
            loop.check_anchor(rid, cache, ids, lag=2)
    t_ingest = time.perf_counter() - t0
    t0 = time.perf_counter()
    zero = torch.zeros(d, device=loop.device, dtype=loop.dtype)
    feat = torch.stack([zero if f is None else f for f in last_feat])  # [R, d]
    P0 = max(c.length for c in caches)
    k_ctx, v_ctx, mask = loop.gather(caches, extra=s.gamma)  # [1, R, H_kv, P0 + γ, hd]
    loop.check_limit("step", "past", mask.shape[1])
    tok = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R] x_{t+1} = anchor
    pos = torch.tensor([ids.numel() - 2 for ids in context.token_ids])  # [R] t = a − 1
    draws, hidden = _Draws(loop, context), []
    for j in range(s.gamma):
        out = loop.runner.run("step", {
            "token_ids": tok[:, None].to(loop.device), "feats": feat[:, None].contiguous(), "positions": pos[:, None],
            "ctx_k": k_ctx, "ctx_v": v_ctx, "ctx_mask": mask})
        at = P0 + j  # the step's K/V slot after the padded context
        k_ctx[:, :, :, at] = out["k_new"][:, :, :, 0]
        v_ctx[:, :, :, at] = out["v_new"][:, :, :, 0]
        mask[:, at] = True
        slot = draws.draw(out["logits"][:, 0])  # [R] draft slot of x̂_j
        hidden.append(out["out"][:, 0])
        nxt = slot if s.vocab_map is None else s.vocab_map.to_target(slot)  # the layer reads target ids
        tok, feat, pos = nxt, out["out"][:, 0], pos + 1
    tokens, q, logits = draws.finish()
    loop.timings = {"draft": time.perf_counter() - t0, "sequential_head": 0.0, "ingest": t_ingest}
    return DraftBlock(
        tokens=tokens, q=q, valid_lengths=loop.valid(context, R), draft_logits=logits,
        hidden=torch.stack(hidden, 1).cpu() if s.returns_hidden else None,  # [R, γ, d] pre-norm outputs
    )
