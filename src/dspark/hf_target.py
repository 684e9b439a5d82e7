"""Batched HF causal LMs as speculative-decoding targets: :class:`HFTarget`.

:class:`HFTarget` wraps any HF ``AutoModelForCausalLM`` whose KV cache is a plain full-attention
``DynamicCache`` (Llama, Qwen3, Mistral without sliding window, ...) and serves many concurrent
requests of different lengths that join and leave at any time (docs/serving-and-benchmarks.md,
"Batching an HF target").

Storage
    Each request owns one KV tensor plus its length (:class:`~dspark.hf_batch_cache.RequestKV`);
    ``rollback`` only lowers the length, ``release`` drops the tensor.

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
    elements (Σ n_r real plus the zeroed left pad), plus Σ (1 + ℓ_r) tokens copied back. The batch
    cache lives in one reused scratch buffer (a fresh tensor per step would pay page faults on first
    touch, several times the copy itself on a CPU); it is freed when the last request is released.
    The gather stays cheaper than the ``torch.cat`` plain HF pays over its own DynamicCache for the
    same padded batch, but it grows linearly with context; a slotted KV store that the forward
    indexes in place would remove it.

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

from dspark.hf_batch_cache import (
    MIN_CAPACITY,
    RequestKV,
    append_new_kv,
    batch_cache,
    gather_padded_past,
    int_vector,
    keep_output,
    probe_kv_layout,
    zero_padded,
)
from dspark.models import cache_kwarg
from dspark.protocols import TargetOutput

__all__ = ["HFTarget"]


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
        self._requests: dict[Any, RequestKV] = {}
        self._scratch = torch.empty(0)  # reused batch-cache buffer, see _scratch_view
        self.capture_layers: tuple[int, ...] = ()
        self.set_capture_layers(capture_layers)
        self._device, self._kv_heads, self._head_dim, self._kv_dtype = probe_kv_layout(
            model, self._cache_arg, self.num_layers)

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
        state, a measurable share of a small model's step on a CPU). None (fall back to it) when the model does not
        have the usual ``layers`` / ``norm`` layout."""
        if not ids:
            return {}
        base = getattr(self.model, "model", None)
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if layers is None or norm is None or len(layers) != self.num_layers:
            return None
        return {k: norm if k == self.num_layers - 1 else layers[k] for k in ids}

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

    def _get(self, request_id: Any) -> RequestKV:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(
                f"unknown request id {request_id!r} (not prefilled, or already released)"
            ) from None

    def _lookup(self, request_ids: Sequence[Any]) -> list[RequestKV]:
        ids = list(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} contain duplicates")
        return [self._get(rid) for rid in ids]

    def _new_store(self, capacity: int) -> RequestKV:
        capacity = min(max(capacity, MIN_CAPACITY), self.max_context)
        kv = torch.empty(
            self.num_layers, 2, self._kv_heads, capacity, self._head_dim,
            dtype=self._kv_dtype, device=self._device,
        )
        return RequestKV(kv)

    # ---------------------------------------------------------------- protocol

    @torch.inference_mode()
    def prefill(self, request_ids: Sequence[Any], token_ids: Sequence[torch.Tensor], *,
                logits: bool = True) -> TargetOutput:
        """Register requests and cache every prompt token but the last (the anchor).

        Returns the logits (and captured hidden states) at the n_r − 1 cached prompt positions,
        right-padded: ``logits`` [R, max n_r − 1, V], ``lengths`` = n_r − 1. ``logits=False`` skips
        the LM head over the prompt (``logits`` [R, 0, V]): the engine needs only the cache and the
        hidden states, and on a CPU the LM head over a prompt is a sizeable share of its prefill.
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
        reqs = [self._new_store(p.numel() - 1 + MIN_CAPACITY) for p in rows]
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
        ell = int_vector("lengths", lengths, len(reqs))  # [R]
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
        keep = int_vector("keep", keep, len(reqs))  # [R]
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
        self, reqs: list[RequestKV], tokens: torch.Tensor, q_lens: torch.Tensor, want_logits: bool = True
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
            buf = gather_padded_past(self._scratch_view(shape), reqs, P)  # [L, 2, R, H, P + q, d]
            keys = [buf[i, 0] for i in range(self.num_layers)]  # [R, H, P + q, d]
            values = [buf[i, 1] for i in range(self.num_layers)]
            slots = torch.arange(P + q)[None, :]  # [1, P + q]
            mask = ((slots >= P - past[:, None]) & (slots < P + q_lens[:, None])).long()  # [R, P + q]
            mask = mask.to(dev)
        cache = batch_cache(keys, values, P)
        position_ids = (past[:, None] + torch.arange(q)[None, :]).to(dev)  # [R, q]
        caught: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(functools.partial(keep_output, caught, k))
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
            append_new_kv(buf, reqs, q_lens, P, self.max_context)
        logits = out.logits if want_logits else out.logits[:, :0]  # [R, q, V] (or [R, 0, V])
        hidden = ({k: caught[k] for k in self.capture_layers} if self._capture_modules is not None
                  else {k: out.hidden_states[k + 1] for k in self.capture_layers})  # {k: [R, q, d]}
        return zero_padded(logits, hidden, q_lens, want_logits)
