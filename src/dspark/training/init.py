"""Starting points for training: draft layers copied from the target's top layers, and the
reduced draft vocabulary chosen from the training data.

Random initialisation wastes a small compute budget (docs/drafters-and-training.md): a draft layer that starts as
the target's own top layer already maps a residual stream to next-token logits through the
target's (frozen, shared) LM head. The fusion layer starts by passing the *highest* captured
target layer through unchanged, normalised with the copied layer's input norm, so the injected
context K/V start as the K/V the copied layer would compute from that state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["init_from_target", "choose_draft_vocab"]


def _decoder_layers(model: Any) -> Any:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError("init_from_target supports HF decoder models with model.model.layers (Llama, Qwen3, …)")
    return inner


def _copy_layer(dst: Any, src: Any) -> None:
    att, mlp = src.self_attn, src.mlp
    pairs = [(dst.q_proj, att.q_proj), (dst.k_proj, att.k_proj), (dst.v_proj, att.v_proj),
             (dst.o_proj, att.o_proj), (dst.gate_proj, mlp.gate_proj), (dst.up_proj, mlp.up_proj),
             (dst.down_proj, mlp.down_proj), (dst.input_norm, src.input_layernorm),
             (dst.post_norm, src.post_attention_layernorm)]
    if hasattr(att, "q_norm") and hasattr(dst.q_norm, "weight"):
        pairs += [(dst.q_norm, att.q_norm), (dst.k_norm, att.k_norm)]
    for d, s in pairs:
        if d.weight.shape != s.weight.shape:
            raise ValueError(f"cannot copy a target layer: shape {tuple(s.weight.shape)} ≠ {tuple(d.weight.shape)}")
        d.weight.data.copy_(s.weight.data.to(d.weight.dtype))


def _copy_eagle3_layer(dst: Any, src: Any) -> None:
    """A target layer into a reference Eagle3 layer (:class:`dspark.drafters.eagle3.model.Eagle3Layer`).

    Its q/k/v read [input_layernorm(emb) ; hidden_norm(h)] (2d wide): the target's q/k/v weights go
    on the hidden half and zeros on the embedding half, and both norms start as the target's
    input norm, so the layer starts as exactly the target's layer applied to h (the residual is
    the un-normed h, as in the target); the embedding half starts silent and is learned.
    """
    att, mlp = src.self_attn, src.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        d, w = getattr(dst.self_attn, name).weight, getattr(att, name).weight
        if d.shape != (w.shape[0], 2 * w.shape[1]):
            raise ValueError(f"cannot copy a target layer: {name} {tuple(w.shape)} does not fit {tuple(d.shape)}")
        d.data.copy_(torch.cat([torch.zeros_like(w), w], 1).to(d.dtype))
    pairs = [(dst.self_attn.o_proj, att.o_proj), (dst.mlp.gate_proj, mlp.gate_proj), (dst.mlp.up_proj, mlp.up_proj),
             (dst.mlp.down_proj, mlp.down_proj), (dst.input_layernorm, src.input_layernorm),
             (dst.hidden_norm, src.input_layernorm), (dst.post_attention_layernorm, src.post_attention_layernorm)]
    if hasattr(att, "q_norm"):
        pairs += [(dst.self_attn.q_norm, att.q_norm), (dst.self_attn.k_norm, att.k_norm)]
    for d, s in pairs:
        if d.weight.shape != s.weight.shape:
            raise ValueError(f"cannot copy a target layer: shape {tuple(s.weight.shape)} ≠ {tuple(d.weight.shape)}")
        d.weight.data.copy_(s.weight.data.to(d.weight.dtype))


@torch.no_grad()
def init_from_target(drafter: Any, model: Any) -> None:
    """Copy the target's top layers into the draft layers (and its final norm), and set the fusion
    to pass the highest captured layer through (identity block, zeros elsewhere). The reference
    Eagle3 layer's 2d-wide q/k/v get the target's weights on the hidden half, zeros on the
    embedding half (:func:`_copy_eagle3_layer`)."""
    inner = _decoder_layers(model)
    layers = list(inner.layers)
    d = drafter.config.layer.hidden_size
    m = len(drafter.target_layer_ids)
    draft_layers = list(drafter.layers) if hasattr(drafter, "layers") else [drafter.layer]
    fc = drafter.fc if hasattr(drafter, "fc") else drafter.fuse  # reference Eagle3 calls its fusion ``fc``
    copy = _copy_eagle3_layer if hasattr(drafter, "fc") else _copy_layer
    for i, dst in enumerate(draft_layers):
        copy(dst, layers[len(layers) - len(draft_layers) + i])
    drafter.norm.weight.data.copy_(inner.norm.weight.data.to(drafter.norm.weight.dtype))
    high = max(range(m), key=lambda i: drafter.target_layer_ids[i])
    w = torch.zeros(d, m * d)
    w[:, high * d : (high + 1) * d] = torch.eye(d)
    fc.weight.data.copy_(w.to(fc.weight.dtype))
    if hasattr(drafter, "fuse_norm"):
        drafter.fuse_norm.weight.data.copy_(draft_layers[0].input_norm.weight.data)
        if getattr(drafter, "mask_embedding", None) is not None:  # pre-reference learned mask
            drafter.mask_embedding.data.copy_(inner.embed_tokens.weight.data.float().mean(0).to(drafter.mask_embedding.dtype))
    if hasattr(drafter, "in_proj"):  # Eagle3: start as emb(x_{t+1}) + f_t
        drafter.in_proj.weight.data.copy_(torch.cat([torch.eye(d), torch.eye(d)], 1).to(drafter.in_proj.weight.dtype))


def choose_draft_vocab(sequences: Iterable[Sequence[int]], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``sequences`` (``always`` first), as target ids [size].

    EAGLE-3 does the same: the drafter only scores tokens the target actually writes; a target
    token outside the set can still be committed (rejection sampling recovers it), it just
    cannot be drafted.
    """
    counts: Counter[int] = Counter()
    for s in sequences:
        counts.update(s)
    chosen = list(dict.fromkeys(int(t) for t in always))
    for tok, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if tok not in chosen:
            chosen.append(tok)
    k = 0
    while len(chosen) < size:  # tiny corpora: pad with the lowest unused ids
        if k not in chosen:
            chosen.append(k)
        k += 1
    return torch.tensor(chosen[:size], dtype=torch.long)
