"""Eagle3's modules: the reference drafter (kind ``eagle3``, DeepSpec's ``Qwen3Eagle3Model``,
parameter for parameter) and dspark's pre-reference layout (kind ``eagle3-fused``, format_version 1
checkpoints: input at position t is W_in[emb(x_{t+1}) ; f_t]), both drafting γ causal steps of one
layer through :func:`~dspark.drafters.eagle3.round.autoregressive_round`.

Terms: d hidden size, m captured target layers, H / H_kv query / key-value heads, hd head dim,
R requests, n positions of one call.

Parameters carry DeepSpec's checkpoint key names exactly (``fc.weight``, ``layers.0.…``,
``norm.weight``), so a DeepSpec / speculators Eagle3 ``model.safetensors`` minus ``embed_tokens``
and ``lm_head`` (dspark binds those from the target, :meth:`bind_target`) loads with
``load_state_dict``. Math (tests/fixtures/reference-drafters/README.md, "Eagle3"):

* h_t = fc(f_t) for a context position (f_t the m target features concatenated, no norm before
  ``fc``), or the layer's own previous output for a drafted position (not passed through fc again);
* the layer at position t reads x_{t+1} (the *next* token) and h_t, at RoPE position t:
  u = [input_layernorm(emb(x_{t+1})) ; hidden_norm(h_t)]   (embedding first, width 2d)
  q, k, v = q/k/v_proj(u); q_norm / k_norm per head; RoPE; causal attention over the cache
  r = h_t + o_proj(attn)                                    (residual: the un-normed h_t)
  out_t = r + down(silu(gate(post_attention_layernorm(r))) · up(…))
* logits = lm_head(norm(out_t)) predict x_{t+2}; out_t is the next step's h.

Only one layer is supported (as in DeepSpec's evaluator): DeepSpec extends its cache with several
tokens without a causal mask, which is harmless only with one layer; here the attention over new
positions is always causal (identical for one layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.eagle3.graphs import autoregressive_graph_specs
from dspark.drafters.eagle3.round import autoregressive_round
from dspark.drafters.layers import (
    DraftLayer,
    LayerShape,
    RMSNorm,
    attend,
    block_mask,
    heads,
    products,
    rope,
    rotated_kv,
)
from dspark.drafters.neural import NeuralDrafter

__all__ = ["AutoregressiveDrafter", "Eagle3Drafter", "Eagle3Layer", "Eagle3FusedDrafter"]


class AutoregressiveDrafter(NeuralDrafter):
    """The Eagle3 kinds (:class:`Eagle3Drafter`, :class:`Eagle3FusedDrafter`): drafting is
    :func:`~dspark.drafters.eagle3.round.autoregressive_round` (per-request causal K/V cache,
    the pending feature of the last context position, γ autoregressive steps).

    A subclass provides ``_fuse(features [n, m·d]) → [n, d]``, ``_run(tokens [R, n], feats
    [R, n, d], positions [R, n], ctx_k, ctx_v, ctx_mask, attn_mask=None) → (out, k, v)`` (one
    causal layer call: the pre-norm outputs [R, n, d] and the new positions' K/V [R, H_kv, n, hd];
    ``attn_mask`` [R, n, P + n] replaces the causal mask, as the training forward needs),
    ``layer`` and ``norm``.
    """

    round = staticmethod(autoregressive_round)
    graph_specs = staticmethod(autoregressive_graph_specs)

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        return ("fuse", "context", "step")

    _returns_hidden = False

    def _num_cached_layers(self) -> int:  # the one causal layer whose K/V the loop caches
        return 1

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        raise NotImplementedError


class Eagle3Attention(nn.Module):
    """Qwen3 attention whose q/k/v read a 2d-wide input (names as HF / DeepSpec ``self_attn``)."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.shape = s
        d, H, Hkv, hd = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(2 * d, H * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, s.rms_norm_eps)
        self.k_norm = RMSNorm(hd, s.rms_norm_eps)

    def kv(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [R, n, 2d], positions [R, n] → K (normed, rotated), V [R, H_kv, n, hd]."""
        return rotated_kv(*products(u, self.k_proj, self.v_proj), positions, self.shape, self.k_norm)

    def forward(
        self,
        u: torch.Tensor,  # [R, n, 2d]
        positions: torch.Tensor,  # [R, n]
        ctx_k: torch.Tensor,  # [R, H_kv, P, hd]
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor | None,  # [R, P] bool, None = all real
        attn_mask: torch.Tensor | None = None,  # [R, n, P + n] bool, replaces the causal mask
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ attention output [R, n, d] (after o_proj), and the new positions' K, V."""
        s = self.shape
        R, n, _ = u.shape
        q, k_new, v_new = products(u, self.q_proj, self.k_proj, self.v_proj)
        q = rope(self.q_norm(heads(q, s.head_dim)), positions, s.rope_theta)  # [R, H, n, hd]
        k_new, v_new = rotated_kv(k_new, v_new, positions, s, self.k_norm)
        k, v = torch.cat([ctx_k, k_new], 2), torch.cat([ctx_v, v_new], 2)  # [R, H_kv, P + n, hd]
        if attn_mask is None:
            ctx = torch.ones(R, ctx_k.shape[2], dtype=torch.bool, device=u.device) if ctx_mask is None else ctx_mask
            attn_mask = block_mask(ctx, n, causal=True)  # [R, n, P + n]
        a = attend(q, k, v, attn_mask)  # [R, H, n, hd]
        return self.o_proj(a.transpose(1, 2).reshape(R, n, s.num_heads * s.head_dim)), k_new, v_new


class Eagle3MLP(nn.Module):
    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = products(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Eagle3Layer(nn.Module):
    """DeepSpec's Eagle3 decoder layer (``layers.0``): see the module docstring."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        d = s.hidden_size
        self.hidden_norm = RMSNorm(d, s.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, s.rms_norm_eps)
        self.self_attn = Eagle3Attention(s)
        self.post_attention_layernorm = RMSNorm(d, s.rms_norm_eps)
        self.mlp = Eagle3MLP(s)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(emb) ; hidden_norm(h)] [..., 2d] (embedding first)."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)

    def kv(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of positions (emb, h [R, n, d], positions [R, n]) alone: a causal layer's K/V of a
        position need no past → K, V [R, H_kv, n, hd]."""
        return self.self_attn.kv(self.attn_input(emb, h), positions)

    def forward(
        self,
        emb: torch.Tensor,  # [R, n, d] embeddings of x_{t+1}
        h: torch.Tensor,  # [R, n, d] incoming hidden h_t
        positions: torch.Tensor,  # [R, n] t
        ctx_k: torch.Tensor,  # [R, H_kv, P, hd]
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor | None = None,  # [R, P]
        attn_mask: torch.Tensor | None = None,  # [R, n, P + n]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ out [R, n, d] (pre-norm; the next step's h), K, V [R, H_kv, n, hd] of the new positions."""
        a, k, v = self.self_attn(self.attn_input(emb, h), positions, ctx_k, ctx_v, ctx_mask, attn_mask)
        r = h + a
        return r + self.mlp(self.post_attention_layernorm(r)), k, v


class Eagle3Drafter(AutoregressiveDrafter):
    """Reference Eagle3 (kind ``eagle3``): ``fc`` over m target features, one Eagle3 layer, ``norm``.

    Inference protocol as :class:`AutoregressiveDrafter` (per-request causal
    cache, the last context feature pending until its next token is known, γ steps);
    ``DraftBlock.hidden`` holds the per-step layer outputs h_j (pre-norm; logits_j = W_lm·norm(h_j)).
    """

    _returns_hidden = True

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)  # DrafterConfig already holds eagle3 to exactly one draft layer
        s = config.layer
        d, m = s.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(s)])
        self.norm = RMSNorm(d, s.rms_norm_eps)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))  # [n, d]

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        return self.layer(self.embed(tokens), feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask)


class Eagle3FusedDrafter(AutoregressiveDrafter):
    """dspark's pre-reference Eagle3 (kind ``eagle3-fused``, format_version 1 checkpoints): one
    causal decoder layer whose input is W_in[emb(x_{t+1}) ; fuse(f_t)] (residual = that
    projection) over fused low/mid/high target features, γ autoregressive steps."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        s = config.layer
        d = s.hidden_size
        self.fuse = nn.Linear(3 * d, d, bias=False)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DraftLayer(s)
        self.norm = RMSNorm(d, s.rms_norm_eps)

    def _inputs(self, next_tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.in_proj(torch.cat([self.embed(next_tokens), feats], dim=-1))  # [..., d]

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fuse(features.to(self.fuse.weight.dtype))  # [n, d]

    def _run(self, tokens, feats, positions, ctx_k, ctx_v, ctx_mask, attn_mask=None):  # noqa: ANN001, ANN202
        x = self._inputs(tokens, feats)  # [R, n, d]
        return self.layer(x, positions, ctx_k, ctx_v, ctx_mask, causal=True, return_kv=True, attn_mask=attn_mask)
