"""A Llama-family decoder step as plain tensor code: the fast path of :class:`~dspark.fast.FastTarget`.

Terms (shape letters used below)
    R   rows (requests) in one forward;  q  new tokens per row;  T  past slots per row;
    L   decoder layers;  D  hidden size;  V  vocabulary;
    H   query heads, H_kv key/value heads, g = H / H_kv query heads per K/V head;  d  head dim.

:class:`LlamaStep` reads the past K/V from a buffer it never writes (``past`` [L, 2, R, H_kv, T, d]
with a validity mask [R, T]) and returns the new tokens' K/V ([L, 2, R, H_kv, q, d]) for the
caller to store. Attention runs over the concatenation past ∪ new: valid past slots, and the new
tokens causally. There is no cache object and no write into an input, so ``torch.compile`` traces
the whole step as one graph and a CUDA graph can replay it.

The arithmetic is HF's (``LlamaRMSNorm``, ``rotate_half`` rotary embedding from the model's own
``rotary_emb``, ``scaled_dot_product_attention`` as HF's default ``sdpa`` attention, SiLU-gated MLP,
optional Qwen3 q/k norms, optional q/k/v biases), so in fp32 the
step is greedy-identical to the HF forward; :func:`supports` names what it does not cover.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark.fast.linear import Linear, fused

__all__ = ["LlamaStep", "supports"]

_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def supports(model: Any) -> str | None:
    """None when :class:`LlamaStep` can run ``model``; otherwise one sentence saying why not."""
    config = _text_config(model)
    kind = getattr(config, "model_type", None)
    if kind not in _ARCHS:
        return f"the fast step covers {', '.join(_ARCHS)} models, not {kind!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the fast step needs a SiLU MLP, this model uses {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if kind == "mistral" or getattr(config, "use_sliding_window", False):
            return "the fast step covers full attention only; this model uses a sliding window"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "the model does not have the usual model.layers / model.rotary_emb layout"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(base.layers[0].self_attn, name):
            return f"decoder layer 0's attention has no {name}"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, scale in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, q, d], cos/sin [R, 1, q, d]."""
    return x * cos + _rotate_half(x) * sin


class _Layer(nn.Module):
    def __init__(self, layer: Any, eps: float, pack: bool) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Linear(*fused(attn.q_proj, attn.k_proj, attn.v_proj), pack=pack)
        self.o = Linear(*fused(attn.o_proj), pack=pack)
        self.gate_up = Linear(*fused(mlp.gate_proj, mlp.up_proj), pack=pack)
        self.down = Linear(*fused(mlp.down_proj), pack=pack)
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else q_norm.weight
        self.k_norm = None if k_norm is None else k_norm.weight
        self.eps = eps


class LlamaStep(nn.Module):
    """One decoder forward over an external read-only past; see the module docstring.

    ``pack=True`` prepacks every linear weight for the CPU's matmul library (oneDNN: AMX / AVX-512
    tiles for bf16, MKL for fp32) once, instead of re-laying it out on every call; leave it off for
    ``torch.compile`` (inductor's freezing packs the weights itself) and on GPUs.
    """

    def __init__(self, model: Any, *, pack: bool = False) -> None:
        super().__init__()
        reason = supports(model)
        if reason is not None:
            raise NotImplementedError(reason)
        config = _text_config(model)
        base = model.model
        eps = float(config.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(layer, eps, pack) for layer in base.layers)
        self.embed = base.embed_tokens.weight  # [V, D]
        self.norm = base.norm.weight
        self.eps = eps
        self.rotary = base.rotary_emb
        self.lm_head = Linear(*fused(model.lm_head), pack=pack)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = self.head_dim ** -0.5
        self.graph_capture: tuple[int, ...] = ()  # what a compiled graph of this step returns (FastTarget)

    def forward(
        self,
        input_ids: torch.Tensor,  # [R, q]
        position_ids: torch.Tensor,  # [R, q]
        past: torch.Tensor,  # [L, 2, R, H_kv, T, d]
        past_valid: torch.Tensor,  # [R, T] bool
        capture: tuple[int, ...] | None = (),
        logits: bool = True,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor]:
        """(logits [R, q, V] or None, the captured layers' outputs [R, q, D] in ``capture``'s
        order, new K/V [L, 2, R, H_kv, q, d]). ``capture=None`` reads :attr:`graph_capture`: a
        compiled graph must not take the layer ids as an argument, because ``torch.compile``
        makes integer arguments symbolic, and a symbolic id is not a Python int to select a layer
        by (the trace fails and the whole step silently runs eager)."""
        if capture is None:
            capture = self.graph_capture
        R, q = input_ids.shape
        H, H_kv, d = self.heads, self.kv_heads, self.head_dim
        g = H // H_kv
        x = F.embedding(input_ids, self.embed)  # [R, q, D]
        cos, sin = self.rotary(x, position_ids)  # [R, q, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, q, d]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()  # [q, q]
        # [R, 1, g·q, T + q]: row i of a query group sees the valid past and new tokens ≤ i
        allowed = torch.cat(
            (past_valid[:, None, :].expand(R, q, -1), causal.expand(R, q, q)), dim=-1
        ).repeat(1, g, 1).unsqueeze(1)
        last = len(self.layers) - 1
        hidden: dict[int, torch.Tensor] = {}
        new_kv = []
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm_in, self.eps)
            qh, kh, vh = layer.qkv(h).split((H * d, H_kv * d, H_kv * d), dim=-1)
            qh = qh.view(R, q, H, d)
            kh = kh.view(R, q, H_kv, d)
            vh = vh.view(R, q, H_kv, d).transpose(1, 2)  # [R, H_kv, q, d]
            if layer.q_norm is not None:
                qh = _rms_norm(qh, layer.q_norm, self.eps)
                kh = _rms_norm(kh, layer.k_norm, self.eps)
            qh = _rope(qh.transpose(1, 2), cos, sin)  # [R, H, q, d]
            kh = _rope(kh.transpose(1, 2), cos, sin)  # [R, H_kv, q, d]
            new_kv.append(torch.stack((kh, vh)))  # [2, R, H_kv, q, d]
            k_all = torch.cat((past[i, 0], kh), dim=2)  # [R, H_kv, T + q, d]
            v_all = torch.cat((past[i, 1], vh), dim=2)
            qg = qh.reshape(R, H_kv, g * q, d)  # query heads grouped under their K/V head
            # one fused kernel, as HF's default (sdpa) attention: the spelled-out product, mask and
            # softmax cost 2-3x as much at a decode step's few query rows, most of all in bf16
            attn = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=allowed, scale=self.scale)  # [R, H_kv, g·q, d]
            attn = attn.reshape(R, H, q, d).transpose(1, 2).reshape(R, q, H * d)
            x = x + layer.o(attn)
            h = _rms_norm(x, layer.norm_post, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i in capture and i != last:
                hidden[i] = x
        x = _rms_norm(x, self.norm, self.eps)
        if last in capture:
            hidden[last] = x
        out = self.lm_head(x) if logits else None
        return out, [hidden[k] for k in capture], torch.stack(new_kv)
