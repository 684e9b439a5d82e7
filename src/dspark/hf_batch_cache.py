"""The KV storage behind :class:`~dspark.hf_target.HFTarget`: one store per request, and the padded
batch cache an HF forward over several requests writes into.

Each request owns one KV tensor ``[L, 2, H_kv, capacity, d_head]`` (all decoder layers, keys and
values) plus its length n_r (:class:`RequestKV`). The capacity grows by doubling; a rollback only
lowers n_r (the stale slots are overwritten by the next forward), a release drops the tensor.

A forward runs on a small :class:`~transformers.cache_utils.Cache` whose layers are *views* of
preallocated key/value tensors (:func:`batch_cache`): each layer writes its new K/V in place after
the past instead of concatenating, which would copy the whole padded past a second time.

Needs transformers ≥ 5 (the ``Cache.layers`` / ``DynamicLayer`` API).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MIN_CAPACITY", "RequestKV", "append_new_kv", "batch_cache", "gather_padded_past", "int_vector", "keep_output",
           "probe_kv_layout", "zero_padded"]

MIN_CAPACITY = 64  # tokens; a request's KV tensor starts at least this long


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


def batch_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], past: int) -> Any:
    """A cache whose layer i writes into ``keys[i]`` / ``values[i]`` [R, H, T, d] after ``past`` slots."""
    slot_layer, cache_class = _cache_classes()
    return cache_class([slot_layer(k, v, past) for k, v in zip(keys, values)])


class RequestKV:
    """One request's KV store: kv [L, 2, H, capacity, d] and its valid length."""

    __slots__ = ("kv", "length", "_views")

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.length = 0
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def layer_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer key and value views [1, H, capacity, d] into kv, made once per allocation
        (made afresh every step they would cost a noticeable share of a small model's CPU step)."""
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


@torch.inference_mode()
def probe_kv_layout(model: Any, cache_arg: str, num_layers: int) -> tuple[torch.device, int, int, torch.dtype]:
    """One 1-token forward of ``model`` to learn each layer's K/V shape → (device, KV heads, head
    dim, KV dtype); a NotImplementedError unless the cache is a plain full-attention DynamicCache
    with one layer of one shape per decoder layer."""
    from transformers import DynamicCache

    try:
        param = next(model.parameters())
    except StopIteration:  # pragma: no cover - a model without parameters
        raise ValueError("the model has no parameters") from None
    device = param.device
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        use_cache=True,
        **{cache_arg: cache},
    )
    shapes = set()
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"HFTarget supports full-attention models with a plain DynamicCache; cache "
                f"layer {i} is a {type(layer).__name__}"
            )
        shapes.add((tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype))
    if len(cache.layers) != num_layers or len(shapes) != 1:
        raise NotImplementedError(
            "HFTarget needs one K/V layer per decoder layer, all of one shape; got "
            f"{len(cache.layers)} layers with shapes {sorted(map(repr, shapes))}"
        )
    (k_shape, v_shape, dtype), = shapes
    if k_shape != v_shape:
        raise NotImplementedError(f"keys {k_shape} and values {v_shape} differ in shape")
    return device, k_shape[1], k_shape[3], dtype


def gather_padded_past(buf: torch.Tensor, reqs: Sequence[RequestKV], past: int) -> torch.Tensor:
    """Copy each request's n_r cached tokens right-aligned into slots [past − n_r, past) of its row
    of ``buf`` [L, 2, R, H, ≥ past, d], zeroing the left pad (masked slots must stay finite)."""
    for r, req in enumerate(reqs):
        pad = past - req.length
        if pad:
            buf[:, :, r, :, :pad].zero_()
        if req.length:
            buf[:, :, r, :, pad:past].copy_(req.kv[:, :, :, : req.length])
    return buf


def append_new_kv(buf: torch.Tensor, reqs: Sequence[RequestKV], q_lens: torch.Tensor, past: int, limit: int) -> None:
    """Copy each row's q_lens[r] real new K/V (slots [past, past + q_lens[r]) of ``buf``) back into
    its request's store, growing it up to ``limit`` tokens; the padded ones are dropped."""
    for r, (req, n) in enumerate(zip(reqs, q_lens.tolist())):
        req.reserve(req.length + n, limit)
        req.kv[:, :, :, req.length : req.length + n].copy_(buf[:, :, r, :, past : past + n])
        req.length += n


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


def keep_output(store: dict[int, torch.Tensor], key: int, module: Any, args: Any, output: Any) -> None:
    """Forward hook: keep a module's output hidden state [R, q, d] under ``key``."""
    store[key] = output[0] if isinstance(output, tuple) else output


def int_vector(name: str, value: Any, size: int) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.ndim != 1 or t.numel() != size:
        raise ValueError(f"{name} must have shape [{size}] (one per request), got {tuple(t.shape)}")
    return t.long().cpu()
