"""Llama/Qwen3-style draft layers with context KV injection.

Terms: R requests, γ block size, n context positions (committed tokens before the anchor), d
hidden size, H query heads, H_kv key/value heads, hd head dim. A draft layer attends from the
block's γ queries to [context K/V ; block K/V]: the context K/V are the layer's *own* k/v
projections of the fused target features (KV injection, docs/concepts.md §1), with k-norm and RoPE at
their absolute positions, cached per request; the block's K/V are discarded after each round.
The block attends bidirectionally to itself (``causal=False``, DSpark/DFlash) or causally
(``causal=True``, Eagle3's autoregressive layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

from dspark.fast.linear import fused

__all__ = ["LayerShape", "RMSNorm", "rope", "heads", "rotated_kv", "block_mask", "attend", "products", "DraftLayer"]


@frozen
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = True  # per-head RMSNorm of q and k (Qwen3); False copies a Llama layer exactly


class RMSNorm(nn.Module):
    """RMS norm whose mean of squares is computed in fp32 whatever the input dtype.

    Target hidden states reach |x| ≈ 2.5e4 (SmolLM2's massive activations), and x² overflows fp16
    above |x| = 256. The casts (``x.float()`` … ``.to(x.dtype)``) also become explicit Casts in the
    fp16/bf16 ONNX graphs, which keep a strongly typed TensorRT engine's norms in fp32
    (``dspark.export``); keep them.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, as HF Llama/Qwen3).

    x [..., H, n, hd]; positions broadcastable to [..., n] (int64 absolute positions).
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = positions.to(torch.float32)[..., None] * inv_freq  # [..., n, hd/2]
    ang = torch.cat([ang, ang], dim=-1).unsqueeze(-3)  # [..., 1, n, hd]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection's output [R, n, heads · hd] → [R, heads, n, hd]."""
    R, n, _ = y.shape
    return y.view(R, n, -1, head_dim).transpose(1, 2)


def rotated_kv(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, shape: LayerShape,
               k_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected k, v [R, n, H_kv · hd] at positions [R, n] → K, V [R, H_kv, n, hd]: K normed by
    ``k_norm`` and rotated (the draft layers' and Eagle3's attention alike)."""
    return rope(k_norm(heads(k, shape.head_dim)), positions, shape.rope_theta), heads(v, shape.head_dim)


def block_mask(ctx_mask: torch.Tensor, g: int, causal: bool) -> torch.Tensor:
    """Attention mask [R, g, P + g] bool of g new positions over [context ; themselves]: every real
    context slot (ctx_mask [R, P]), and the new positions bidirectionally or (``causal``) causally."""
    R = ctx_mask.shape[0]
    blk = torch.ones(g, g, dtype=torch.bool, device=ctx_mask.device)
    if causal:
        blk = torch.tril(blk)
    return torch.cat([ctx_mask[:, None, :].expand(R, g, -1), blk.expand(R, g, g)], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: q [R, H, g, hd] over k, v [R, H_kv, P, hd] (each K/V head shared by
    H / H_kv query heads), mask [R, g, P] bool → [R, H, g, hd].

    The query heads sharing a K/V head go through the kernel as one head of G = H / H_kv times the
    rows, as the target's step does (:mod:`dspark.fast.llama`), instead of copying each K/V head G
    times: the same products and softmax per query row, on fewer, taller heads."""
    R, H, g, hd = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    qg = q.reshape(R, H_kv, G * g, hd)  # query head h = j·G + i sits under K/V head j
    grouped_mask = mask.repeat(1, G, 1)[:, None]  # [R, 1, G·g, P]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=grouped_mask).reshape(R, H, g, hd)


def products(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """``x`` through each of several linear layers of the same input, one output each.

    Compiled for inference on a CPU (``torch.compile``, no gradient, not an export), as one
    product over their concatenated weights, split after: weight freezing folds the concatenation
    into one constant, packed once, and one wider product reads ``x`` once and fills the matmul
    kernel's blocks better than several narrow ones (at the few rows of a draft block, the products
    are most of the backbone's time). Elsewhere one product each: eager or in a GPU's graph (no
    freezing) a concatenation would copy the weights every call, and training keeps its own graph."""
    if len(linears) > 1 and x.device.type == "cpu" and torch.compiler.is_compiling() \
            and not torch.compiler.is_exporting() and not torch.is_grad_enabled():
        return F.linear(x, *fused(*linears)).split([m.out_features for m in linears], dim=-1)
    return tuple(m(x) for m in linears)


class DraftLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, with an extra path that projects context features to K/V."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        s = shape
        self.shape = s
        d, H, Hkv, hd = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
        self.input_norm = RMSNorm(d, s.rms_norm_eps)
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, s.rms_norm_eps) if s.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, s.rms_norm_eps) if s.qk_norm else nn.Identity()
        self.post_norm = RMSNorm(d, s.rms_norm_eps)
        self.gate_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, d, bias=False)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, n, d], positions [R, n] → K, V [R, H_kv, n, hd] (K normed and rotated)."""
        k, v = products(x, self.k_proj, self.v_proj)
        return rotated_kv(k, v, positions, self.shape, self.k_norm)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV injection: fused context features ctx [R, n, d] at positions [R, n] → K, V."""
        return self._kv(ctx, positions)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor,
        causal: bool = False,
        return_kv: bool = False,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer over the block.

        x [R, γ, d] block states; positions [R, γ]; ctx_k/ctx_v [R, H_kv, n, hd] injected context
        (padded); ctx_mask [R, n] bool, True where a context slot is real. Returns [R, γ, d], and
        with ``return_kv`` also the block's own K, V [R, H_kv, γ, hd] (Eagle3 caches them).
        ``attn_mask`` [R, γ, n+γ] bool replaces the mask built from ctx_mask/causal (training packs
        many blocks of one sequence into one call and needs a block-diagonal mask).
        """
        R, g, _ = x.shape
        s = self.shape
        h = self.input_norm(x)
        q, k_blk, v_blk = products(h, self.q_proj, self.k_proj, self.v_proj)
        q = rope(self.q_norm(heads(q, s.head_dim)), positions, s.rope_theta)  # [R, H, γ, hd]
        k_blk, v_blk = rotated_kv(k_blk, v_blk, positions, s, self.k_norm)  # [R, H_kv, γ, hd]
        k = torch.cat([ctx_k, k_blk], dim=2)  # [R, H_kv, n+γ, hd]
        v = torch.cat([ctx_v, v_blk], dim=2)
        mask = attn_mask if attn_mask is not None else block_mask(ctx_mask, g, causal)  # [R, γ, n+γ]
        attn = attend(q, k, v, mask)  # [R, H, γ, hd]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(R, g, s.num_heads * s.head_dim))
        h = self.post_norm(x)
        gate, up = products(h, self.gate_proj, self.up_proj)
        out = x + self.down_proj(F.silu(gate) * up)
        return (out, k_blk, v_blk) if return_kv else out
