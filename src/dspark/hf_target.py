"""Batched HF causal LMs as speculative-decoding targets: :class:`HFTarget`.

:class:`HFTarget` wraps any HF ``AutoModelForCausalLM`` whose KV cache is a plain full-attention
``DynamicCache`` (Llama, Qwen3, Mistral without sliding window, ...) and serves many concurrent
requests of different lengths that join and leave at any time (docs/serving-and-benchmarks.md, "Batching an HF
target").

Storage
    Each request owns one KV tensor ``[L, 2, H_kv, capacity, d_head]`` (all decoder layers, keys
    and values) plus its length n_r. The capacity grows by doubling; ``rollback`` only lowers n_r
    (the stale slots are overwritten by the next forward), ``release`` drops the tensor.

One batched forward (``verify``; ``prefill`` is the same with no past)
    With past lengths n_r, P = max_r n_r and q = 1 + max_r ℓ_r new tokens per row, a padded batch
    cache ``[L, 2, R, H_kv, P + q, d_head]`` is gathered: request r's past is copied right-aligned
    into slots [P − n_r, P) (LEFT padding, the P − n_r pad slots are zeroed so that masked slots are
    finite), its 1 + ℓ_r new tokens go to slots [P, P + 1 + ℓ_r) and the rest of the row is RIGHT
    padding. The model runs on ``input_ids`` [R, q] (pad ids replaced by 0) with

    * ``position_ids`` [R, q] = n_r + arange(q): positions are per request, never padded ones;
    * a 2D ``attention_mask`` [R, P + q]: 1 on the n_r real past slots and the 1 + ℓ_r real new
      slots, 0 on the left pad and on the right pad. transformers turns it into the causal 4D mask
      with query offset P, so a real token at slot P + i sees exactly its request's past and its
      new tokens ≤ i: padded past slots are masked out and right-padded tokens lie causally after
      every real token. A padded query row still sees its request's anchor, so no row is fully
      masked (no NaN from SDPA);
    * a small :class:`~transformers.cache_utils.Cache` whose layers are *views* of the gathered
      batch tensor: each layer writes its new K/V in place into slots [P, P + q) instead of
      concatenating (which would copy the whole padded past a second time).

    Afterwards the 1 + ℓ_r real new K/V of each row are copied back into the request's own tensor;
    the padded ones are dropped. With one request (R = 1) nothing is padded or gathered: the layers
    are views of the request's own tensor and the forward writes straight into it.

Cost (why ``accounting = "padded"``)
    The forward computes R × (1 + max ℓ) tokens against R × (P + q) key slots: every row pays for
    the longest draft and attends over the longest past. The cost model must therefore price
    B = R · (1 + max ℓ) (:func:`dspark.cost_models.batch_size`). On top of the forward, each step
    with R > 1 copies every request's past into the batch cache: R · P · L · 2 · H_kv · d_head
    elements (Σ n_r real plus the zeroed left pad), e.g. SmolLM2-135M (L = 30, H_kv = 3,
    d_head = 64, fp32: 46 KB per token) at R = 16, P = 128 copies ~94 MB per step, plus
    Σ (1 + ℓ_r) tokens copied back. The batch cache lives in one reused scratch buffer (a fresh
    94 MB tensor per step costs ~5× the copy in page faults on CPU); it is freed when the last
    request is released. Measured on the 2-core EPYC: the gather is ~5 ms of a ~80 ms step at
    R = 16, q = 1 — still less than plain HF pays for the ``torch.cat`` of its own DynamicCache
    over the same padded batch. The copy grows linearly with context, which is the known cost of
    approach (b); a slotted KV store (approach (c)) would remove it.

Hidden states
    ``capture_layers`` are 0-based decoder-layer ids; id k is the OUTPUT of decoder layer k, i.e.
    HF ``hidden_states[k + 1]`` (``hidden_states[0]`` is the embedding output). For the last layer
    HF returns the output after the final norm, and so does this class.

Needs transformers ≥ 5 (the ``Cache.layers`` / ``DynamicLayer`` API).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dspark.drafters.config import default_layer_ids
from dspark.models import cache_kwarg
from dspark.protocols import TargetOutput

__all__ = ["HFTarget", "default_layer_ids"]

_MIN_CAPACITY = 64  # tokens; a request's KV tensor starts at least this long


_CACHE_CLASSES: tuple[type, type] | None = None


def _cache_classes() -> tuple[type, type]:
    """(SlotLayer, BatchCache), built on first use so importing this module stays cheap."""
    global _CACHE_CLASSES
    if _CACHE_CLASSES is not None:
        return _CACHE_CLASSES
    try:
        from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
    except ImportError as err:  # transformers < 5
        raise ImportError("HFTarget needs transformers >= 5 (the Cache.layers API)") from err

    class SlotLayer(DynamicLayer):
        """A full-attention layer over preallocated views keys/values [R, H, T, d].

        Slots [0, past) already hold the (padded) past; ``update`` writes the new K/V in place
        after them instead of concatenating.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
            super().__init__()
            self.keys, self.values = keys, values
            self.filled = past
            self.device = keys.device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # already allocated
            return None

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.filled + key_states.shape[-2]
            if end > self.keys.shape[-2]:
                raise RuntimeError(f"batch cache overflow: {end} > {self.keys.shape[-2]} slots")
            self.keys[:, :, self.filled : end] = key_states
            self.values[:, :, self.filled : end] = value_states
            self.filled = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_seq_length(self) -> int:
            return self.filled

        def get_max_length(self) -> int:
            return self.keys.shape[-2]

    class BatchCache(DynamicCache):
        """A DynamicCache whose layers are :class:`SlotLayer` views."""

        def __init__(self, layers: list) -> None:
            Cache.__init__(self, layers=layers)

    _CACHE_CLASSES = (SlotLayer, BatchCache)
    return _CACHE_CLASSES


def _batch_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], past: int) -> Any:
    slot_layer, batch_cache = _cache_classes()
    return batch_cache([slot_layer(k, v, past) for k, v in zip(keys, values)])


class _Request:
    """One request's KV store: kv [L, 2, H, capacity, d] and its valid length."""

    __slots__ = ("kv", "length", "_views")

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.length = 0
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def layer_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer key and value views [1, H, capacity, d] into kv, made once per allocation
        (60 views a step are ~1 % of a 135M model's CPU step)."""
        if self._views is None:
            L = self.kv.shape[0]
            self._views = ([self.kv[i, 0].unsqueeze(0) for i in range(L)],
                           [self.kv[i, 1].unsqueeze(0) for i in range(L)])
        return self._views

    def reserve(self, needed: int, limit: int) -> None:
        capacity = self.kv.shape[3]
        if needed <= capacity:
            return
        new_cap = min(max(needed, 2 * capacity), max(limit, needed))
        shape = list(self.kv.shape)
        shape[3] = new_cap
        grown = self.kv.new_zeros(shape)
        grown[:, :, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self.kv = grown
        self._views = None


def zero_padded(logits: torch.Tensor, hidden: dict[int, torch.Tensor], q_lens: torch.Tensor,
                with_logits: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Zero the right-padded positions (≥ q_lens[r]) of logits [R, q, V] (when ``with_logits``)
    and of every hidden state [R, q, d]: a padded position carries no prediction."""
    q = hidden[next(iter(hidden))].shape[1] if hidden else logits.shape[1]
    pad = torch.arange(q)[None, :] >= q_lens[:, None]  # [R, q]
    if bool(pad.any()):
        pad = pad.to(logits.device)[..., None]
        if with_logits:
            logits = logits.masked_fill(pad, 0.0)
        hidden = {k: h.masked_fill(pad, 0.0) for k, h in hidden.items()}
    return logits, hidden


def _keep_output(store: dict[int, torch.Tensor], key: int, module: Any, args: Any, output: Any) -> None:
    """Forward hook: keep a module's output hidden state [R, q, d] under ``key``."""
    store[key] = output[0] if isinstance(output, tuple) else output


def _int_vector(name: str, value: Any, size: int) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.ndim != 1 or t.numel() != size:
        raise ValueError(f"{name} must have shape [{size}] (one per request), got {tuple(t.shape)}")
    return t.long().cpu()


class HFTarget:
    """A :class:`dspark.protocols.TargetModel` over an HF causal LM, many requests batched.

    See the module docstring for how the per-request caches are padded into one forward.
    ``capture_layers`` (0-based decoder-layer ids, id k = HF ``hidden_states[k + 1]``) selects the
    hidden states returned with every :class:`TargetOutput`; none → ``hidden_states=None``.
    The model should be in eval mode (``load_causal_lm`` puts it there).
    """

    accounting = "padded"
    path = "eager"  # how the forward runs: the HF model's own (dspark.fast offers faster ones)

    def __init__(self, model: Any, tokenizer: Any = None, capture_layers: Iterable[int] = ()) -> None:
        config = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.max_context = int(config.max_position_embeddings)
        self._cache_arg = cache_kwarg(model)
        self._requests: dict[Any, _Request] = {}
        self._scratch = torch.empty(0)  # reused batch-cache buffer, see _scratch_view
        self.capture_layers: tuple[int, ...] = ()
        self.set_capture_layers(capture_layers)
        self._probe_kv_layout()

    # ---------------------------------------------------------------- configuration

    def set_capture_layers(self, ids: Iterable[int]) -> None:
        """Select the decoder layers (0-based) whose output hidden states are returned."""
        ids = tuple(ids)
        valid = f"valid decoder-layer ids are 0..{self.num_layers - 1} (num_layers={self.num_layers})"
        for k in ids:
            if isinstance(k, bool) or not isinstance(k, int):
                raise TypeError(f"capture layer id {k!r} is not an integer; {valid}")
            if not 0 <= k < self.num_layers:
                raise ValueError(f"capture layer id {k} is out of range: {valid}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"capture layer ids {list(ids)} contain duplicates")
        self.capture_layers = ids
        self._capture_modules = self._find_capture_modules(ids)

    def _find_capture_modules(self, ids: tuple[int, ...]) -> dict[int, Any] | None:
        """The modules whose outputs are HF's ``hidden_states[k + 1]``: decoder layer k, and for the
        last layer the final norm (HF reports the last hidden state after it). Capturing them with
        forward hooks costs nothing measurable; ``output_hidden_states`` collects every layer's
        state (~2 % of a SmolLM2 bf16 step on CPU). None (fall back to it) when the model does not
        have the usual ``layers`` / ``norm`` layout."""
        if not ids:
            return {}
        base = getattr(self.model, "model", None)
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if layers is None or norm is None or len(layers) != self.num_layers:
            return None
        return {k: norm if k == self.num_layers - 1 else layers[k] for k in ids}

    @torch.inference_mode()
    def _probe_kv_layout(self) -> None:
        """One 1-token forward to learn each layer's K/V shape; checks the cache is supported."""
        from transformers import DynamicCache

        try:
            param = next(self.model.parameters())
        except StopIteration:  # pragma: no cover - a model without parameters
            raise ValueError("the model has no parameters") from None
        self._device = param.device
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=self._device),
            use_cache=True,
            **{self._cache_arg: cache},
        )
        shapes = set()
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "is_sliding", False) or type(layer).__name__ != "DynamicLayer":
                raise NotImplementedError(
                    f"HFTarget supports full-attention models with a plain DynamicCache; cache "
                    f"layer {i} is a {type(layer).__name__}"
                )
            shapes.add((tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype))
        if len(cache.layers) != self.num_layers or len(shapes) != 1:
            raise NotImplementedError(
                "HFTarget needs one K/V layer per decoder layer, all of one shape; got "
                f"{len(cache.layers)} layers with shapes {sorted(map(repr, shapes))}"
            )
        (k_shape, v_shape, dtype), = shapes
        if k_shape != v_shape:
            raise NotImplementedError(f"keys {k_shape} and values {v_shape} differ in shape")
        self._kv_heads, self._head_dim, self._kv_dtype = k_shape[1], k_shape[3], dtype

    # ---------------------------------------------------------------- request bookkeeping

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> tuple[Any, ...]:
        """The live requests, in the order they were prefilled."""
        return tuple(self._requests)

    def cached_length(self, request_id: Any) -> int:
        """Tokens in the request's KV cache (every committed token except the anchor)."""
        return self._get(request_id).length

    def release(self, request_id: Any) -> None:
        """Forget a request and free its cache."""
        self._get(request_id)
        del self._requests[request_id]
        if not self._requests:
            self._scratch = torch.empty(0)

    def _get(self, request_id: Any) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(
                f"unknown request id {request_id!r} (not prefilled, or already released)"
            ) from None

    def _lookup(self, request_ids: Sequence[Any]) -> list[_Request]:
        ids = list(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} contain duplicates")
        return [self._get(rid) for rid in ids]

    def _new_store(self, capacity: int) -> _Request:
        capacity = min(max(capacity, _MIN_CAPACITY), self.max_context)
        kv = torch.empty(
            self.num_layers, 2, self._kv_heads, capacity, self._head_dim,
            dtype=self._kv_dtype, device=self._device,
        )
        return _Request(kv)

    # ---------------------------------------------------------------- protocol

    @torch.inference_mode()
    def prefill(self, request_ids: Sequence[Any], token_ids: Sequence[torch.Tensor], *,
                logits: bool = True) -> TargetOutput:
        """Register requests and cache every prompt token but the last (the anchor).

        Returns the logits (and captured hidden states) at the n_r − 1 cached prompt positions,
        right-padded: ``logits`` [R, max n_r − 1, V], ``lengths`` = n_r − 1. ``logits=False`` skips
        the LM head over the prompt (``logits`` [R, 0, V]): the engine needs only the cache and the
        hidden states, and on a CPU the LM head over a 50-token prompt is ~20 % of its prefill.
        """
        want_logits = logits
        ids = list(request_ids)
        prompts = list(token_ids)
        if len(ids) != len(prompts):
            raise ValueError(f"{len(ids)} request ids but {len(prompts)} prompts")
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} contain duplicates")
        rows = []
        for rid, prompt in zip(ids, prompts):
            if rid in self._requests:
                raise ValueError(f"request {rid!r} already exists; release it before reusing its id")
            p = torch.as_tensor(prompt)
            if p.dtype.is_floating_point or p.dtype == torch.bool:
                raise TypeError(f"prompt of request {rid!r} must hold token ids, got {p.dtype}")
            p = p.reshape(-1).long()
            if p.numel() == 0:
                raise ValueError(f"prompt of request {rid!r} is empty")
            if p.numel() > self.max_context:
                raise ValueError(
                    f"prompt of request {rid!r} has {p.numel()} tokens, more than the target's "
                    f"max_context {self.max_context}"
                )
            if int(p.min()) < 0 or int(p.max()) >= self.vocab_size:
                raise ValueError(
                    f"prompt of request {rid!r} holds token ids outside [0, {self.vocab_size})"
                )
            rows.append(p)
        reqs = [self._new_store(p.numel() - 1 + _MIN_CAPACITY) for p in rows]
        lengths = torch.tensor([p.numel() - 1 for p in rows], dtype=torch.long)  # [R]
        width = int(lengths.max()) if ids else 0
        run = [i for i, n in enumerate(lengths.tolist()) if n > 0]  # prompts longer than 1
        out_logits, out_hidden = None, {}
        if run:
            tokens = torch.zeros(len(run), width, dtype=torch.long)  # [R_run, width]
            for j, i in enumerate(run):
                tokens[j, : lengths[i]] = rows[i][:-1]
            out_logits, out_hidden = self._forward([reqs[i] for i in run], tokens, lengths[run], want_logits)
        for rid, req in zip(ids, reqs):  # registered only once the forward succeeded
            self._requests[rid] = req
        if len(run) == len(ids) and out_logits is not None:
            logits, hidden = out_logits, out_hidden
        else:  # some rows had nothing to run: scatter into zero rows
            dtype = out_logits.dtype if out_logits is not None else self._kv_dtype
            logits = torch.zeros(len(ids), width if want_logits else 0, self.vocab_size, dtype=dtype, device=self._device)
            hidden = {
                k: torch.zeros(len(ids), width, self.hidden_size, dtype=dtype, device=self._device)
                for k in self.capture_layers
            }
            if run:
                logits[run] = out_logits
                for k in self.capture_layers:
                    hidden[k][run] = out_hidden[k]
        return TargetOutput(
            logits=logits, lengths=lengths, hidden_states=hidden if self.capture_layers else None
        )

    @torch.inference_mode()
    def verify(
        self, request_ids: Sequence[Any], tokens: torch.Tensor, lengths: torch.Tensor
    ) -> TargetOutput:
        """Score each request's anchor + ℓ_r drafts (``tokens`` [R, 1 + γ], ``lengths`` [R] = ℓ_r).

        Appends their K/V to the caches and returns ``logits`` [R, 1 + γ, V] (right-padded, zero
        beyond 1 + ℓ_r), ``lengths`` = 1 + ℓ_r and the captured hidden states [R, 1 + γ, d].
        """
        reqs = self._lookup(request_ids)
        tokens = torch.as_tensor(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != len(reqs) or tokens.shape[1] < 1:
            raise ValueError(
                f"tokens must have shape [R={len(reqs)}, 1 + γ], got {tuple(tokens.shape)}"
            )
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must hold token ids, got {tokens.dtype}")
        gamma = tokens.shape[1] - 1
        ell = _int_vector("lengths", lengths, len(reqs))  # [R]
        if ell.numel() and (int(ell.min()) < 0 or int(ell.max()) > gamma):
            raise ValueError(f"lengths must lie in [0, γ={gamma}], got {ell.tolist()}")
        q_lens = ell + 1  # [R]
        for rid, req, q in zip(request_ids, reqs, q_lens.tolist()):
            if req.length + q > self.max_context:
                raise ValueError(
                    f"request {rid!r} would reach {req.length + q} tokens, beyond the target's "
                    f"max_context {self.max_context}"
                )
        valid = torch.arange(gamma + 1)[None, :] < q_lens[:, None]  # [R, 1 + γ]
        tokens = torch.where(valid, tokens.long().cpu(), 0)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"tokens hold ids outside [0, {self.vocab_size})")
        R = len(reqs)
        if R == 0:
            empty = torch.zeros(0, gamma + 1, self.vocab_size, device=self._device)
            hs = {k: torch.zeros(0, gamma + 1, self.hidden_size, device=self._device)
                  for k in self.capture_layers}
            return TargetOutput(empty, q_lens, hs if self.capture_layers else None)
        q = int(q_lens.max())
        logits, hidden = self._forward(reqs, tokens[:, :q], q_lens)  # [R, q, V]
        if q < gamma + 1:
            logits = torch.nn.functional.pad(logits, (0, 0, 0, gamma + 1 - q))
            hidden = {k: torch.nn.functional.pad(h, (0, 0, 0, gamma + 1 - q)) for k, h in hidden.items()}
        return TargetOutput(
            logits=logits, lengths=q_lens, hidden_states=hidden if self.capture_layers else None
        )

    def rollback(self, request_ids: Sequence[Any], keep: torch.Tensor) -> None:
        """Keep the first keep_r cached tokens of each request (anchor + accepted drafts)."""
        reqs = self._lookup(request_ids)
        keep = _int_vector("keep", keep, len(reqs))  # [R]
        for rid, req, k in zip(request_ids, reqs, keep.tolist()):
            if not 0 <= k <= req.length:
                raise ValueError(
                    f"rollback of request {rid!r} to {k} tokens: must lie in [0, {req.length}] "
                    "(its cached length)"
                )
        for req, k in zip(reqs, keep.tolist()):
            req.length = k

    # ---------------------------------------------------------------- the batched forward

    def _scratch_view(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the reused batch-cache buffer (a fresh large tensor each step would pay
        page faults on first touch, several times the cost of the copy itself on CPU)."""
        numel = 1
        for n in shape:
            numel *= n
        s = self._scratch
        if s.numel() < numel or s.dtype != self._kv_dtype or s.device != self._device:
            self._scratch = torch.empty(
                numel + numel // 4, dtype=self._kv_dtype, device=self._device
            )
        return self._scratch[:numel].view(shape)


    def _forward(
        self, reqs: list[_Request], tokens: torch.Tensor, q_lens: torch.Tensor, want_logits: bool = True
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One padded forward of ``tokens`` [R, q] (row r valid up to q_lens[r]) after each past.

        Appends the valid new K/V to each request; returns logits [R, q, V] (``want_logits=False``:
        [R, 0, V], the LM head over the last position only) and hidden states {k: [R, q, d]}, both
        zero at padded positions.
        """
        R, q = tokens.shape
        past = torch.tensor([req.length for req in reqs], dtype=torch.long)  # [R]
        P = int(past.max())
        dev = self._device
        if R == 1:
            req = reqs[0]
            req.reserve(P + q, self.max_context)
            keys, values = req.layer_views()  # L × [1, H, cap, d]: the forward writes straight into kv
            mask = None
        else:
            shape = (self.num_layers, 2, R, self._kv_heads, P + q, self._head_dim)
            buf = self._scratch_view(shape)  # [L, 2, R, H, P + q, d]
            for r, req in enumerate(reqs):
                pad = P - req.length
                if pad:
                    buf[:, :, r, :, :pad].zero_()
                if req.length:
                    buf[:, :, r, :, pad:P].copy_(req.kv[:, :, :, : req.length])
            keys = [buf[i, 0] for i in range(self.num_layers)]  # [R, H, P + q, d]
            values = [buf[i, 1] for i in range(self.num_layers)]
            slots = torch.arange(P + q)[None, :]  # [1, P + q]
            mask = ((slots >= P - past[:, None]) & (slots < P + q_lens[:, None])).long()  # [R, P + q]
            mask = mask.to(dev)
        cache = _batch_cache(keys, values, P)
        position_ids = (past[:, None] + torch.arange(q)[None, :]).to(dev)  # [R, q]
        caught: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(functools.partial(_keep_output, caught, k))
                 for k, m in (self._capture_modules or {}).items()]
        try:
            out = self.model(
                input_ids=tokens.to(dev),
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                output_hidden_states=bool(self.capture_layers) and self._capture_modules is None,
                **{self._cache_arg: cache},
                **({} if want_logits else {"logits_to_keep": 1}),
            )
        finally:
            for h in hooks:
                h.remove()
        if R == 1:
            reqs[0].length += int(q_lens[0])
        else:
            for r, (req, n) in enumerate(zip(reqs, q_lens.tolist())):
                req.reserve(req.length + n, self.max_context)
                req.kv[:, :, :, req.length : req.length + n].copy_(buf[:, :, r, :, P : P + n])
                req.length += n
        logits = out.logits if want_logits else out.logits[:, :0]  # [R, q, V] (or [R, 0, V])
        hidden = ({k: caught[k] for k in self.capture_layers} if self._capture_modules is not None
                  else {k: out.hidden_states[k + 1] for k in self.capture_layers})  # {k: [R, q, d]}
        return zero_padded(logits, hidden, q_lens, want_logits)
