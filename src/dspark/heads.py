"""Sequential heads and the confidence head: the cheap per-position part of a DSpark drafter.

Terms, once (docs/concepts.md §1). V vocabulary size, d hidden size of the drafter backbone, r the
head's rank (default 256), R requests, γ block size. h_j [.., d] is the backbone state at draft
position j, U_j [.., V] the base logits W_lm h_j, x̂_{j-1} the previous token (x̂_0 = the anchor).
A sequential head adds a correction b: Ũ_j = U_j + b(x̂_{j-1}, h_j), and x̂_j ~ softmax(Ũ_j / T).
Every head embeds x̂_{j-1} with W_down (an nn.Embedding V×r) and maps back with W_up (r → V).

* ``vanilla-markov``: b = W_up · W_down[x̂_{j-1}] (the paper's eq. 5 and the reference: no
  nonlinearity; W_up·W_down is a rank-r bigram table).
* ``gated-markov``:   g = σ(W_g [h_j ; W_down[x̂_{j-1}]]), b = W_up(g ⊙ W_down[x̂_{j-1}]).
* ``rnn``: (g, c, o) = W [s_{j-1} ; W_down[x̂_{j-1}] ; h_j], s_j = σ(g) ⊙ s_{j-1} + (1 − σ(g)) ⊙
  tanh(c), b = W_up(tanh(o)), with s_0 = 0 (state size r).
* ``silu-markov``: b = W_up · SiLU(W_down[x̂_{j-1}]) — dspark's pre-reference vanilla head, kept
  only so format_version 1 checkpoints load; no reference format can hold it.

Parameter names ↔ the reference (DeepSpec / speculators / vLLM): W_down = ``markov_w1`` (an
embedding [V, r]), W_up = ``markov_w2`` ([V, r]), W_g = ``gate_proj`` (input [h ; e]), the RNN's W =
``joint_proj`` (input [s ; e ; h], output chunks gate, candidate, output);
``dspark.drafters.formats`` maps them.

W_up starts at zero, so b ≡ 0 and a fresh head is the identity correction Ũ = U: training starts
from exactly the DFlash backbone's behaviour (its acceptance, its calibration) and the head only
learns what improves on it, instead of first having to undo a random perturbation of V logits.

``step`` is one position (inference, γ−1 calls per round; traceable for ONNX export: no Python
branching on tensor values). ``forward`` is the teacher-forced form used in training, where the
previous tokens are known: the Markov heads are one tensor op over all positions; the RNN loops
over γ only for the r-sized recurrence and projects to V once.

The confidence head (c_j = σ(w · [h_j ; W_down[x̂_{j-1}]] + b)) reads h_j and x̂_{j-1} only, never
x̂_j: that makes truncating a draft at a confidence-based length a stopping rule (lossless).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from attrs import field, frozen
from torch import nn

__all__ = [
    "HEAD_KINDS",
    "HeadConfig",
    "VanillaMarkovHead",
    "GatedMarkovHead",
    "RNNHead",
    "SiluMarkovHead",
    "ConfidenceHead",
    "build_head",
]

HEAD_KINDS = ("vanilla-markov", "gated-markov", "rnn", "silu-markov")


def _require_positive(owner: str, what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{what} must be a positive int, got {value!r}")


def _positive_int(instance: Any, attribute: Any, value: Any) -> None:
    _require_positive(type(instance).__name__, attribute.name, value)


def _known_kind(instance: Any, attribute: Any, value: Any) -> None:
    if value not in HEAD_KINDS:
        raise ValueError(
            f"unknown sequential head kind {value!r}; known: {', '.join(HEAD_KINDS)}"
        )


@frozen
class HeadConfig:
    """Shape of a sequential head: its kind, V (vocab_size), d (hidden_size) and r (rank)."""

    kind: str = field(validator=_known_kind)
    vocab_size: int = field(validator=_positive_int)
    hidden_size: int = field(validator=_positive_int)
    rank: int = field(default=256, validator=_positive_int)


# --------------------------------------------------------------------------------------------
# Sequential heads
# --------------------------------------------------------------------------------------------


class _SequentialHeadBase(nn.Module):
    """Shared parts: the config, W_down, the zero-initialised W_up, and the V-sized add.

    Subclasses set ``name`` and implement ``_correction`` (Markov heads) or override
    ``step``/``forward`` (the RNN).
    """

    name: ClassVar[str]
    #: b reads x̂_{j-1} and nothing else, so its rows can be kept per token
    #: (:mod:`dspark.drafters.dspark.rows`)
    correction_reads_previous_token_only: ClassVar[bool] = False

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256) -> None:
        super().__init__()
        self.config = HeadConfig(self.name, vocab_size, hidden_size, rank)
        self.w_down = nn.Embedding(vocab_size, rank)  # [V, r]
        self.w_up = nn.Linear(rank, vocab_size, bias=False)  # [V, r]
        nn.init.zeros_(self.w_up.weight)  # b ≡ 0 at initialisation: Ũ = U (module docstring)

    @classmethod
    def from_config(cls, config: HeadConfig) -> _SequentialHeadBase:
        """Build the head ``config.kind`` (from a concrete class, the kind must be that class's)."""
        if cls is not _SequentialHeadBase and config.kind != cls.name:
            raise ValueError(f"{cls.__name__} is kind {cls.name!r}, config says {config.kind!r}")
        return _HEADS[config.kind](config.vocab_size, config.hidden_size, config.rank)

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W_down[x̂_{j-1}]: [...] int64 → [..., r]. Also the confidence head's token input."""
        return self.w_down(prev_tokens)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.w_down.weight.dtype)

    @staticmethod
    def _add(base_logits: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Ũ = U + b in U's dtype (the backbone may run in bf16 while the head is fp32)."""
        return base_logits + b.to(base_logits.dtype)

    def _correction(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """b(x̂_{j-1}, h_j) for any leading shape: [...], [..., d] → [..., V]."""
        raise NotImplementedError

    def step(
        self,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        state: Any = None,
    ) -> tuple[torch.Tensor, Any]:
        """One position: x̂_{j-1} [R], h_j [R, d], U_j [R, V] → (Ũ_j [R, V], None). Stateless."""
        return self._add(base_logits, self._correction(prev_tokens, hidden)), None

    def forward(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced: x̂_{0..γ-1} [R, γ], h [R, γ, d], U [R, γ, V] → Ũ [R, γ, V]."""
        _check_block(prev_tokens, hidden, base_logits, self.config)
        return self._add(base_logits, self._correction(prev_tokens, hidden))  # [R, γ, V]

    def extra_repr(self) -> str:
        c = self.config
        return f"V={c.vocab_size}, d={c.hidden_size}, r={c.rank}"


def _check_block(
    prev_tokens: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor, config: HeadConfig
) -> None:
    lead = tuple(prev_tokens.shape)
    if (
        tuple(hidden.shape) != (*lead, config.hidden_size)
        or tuple(base_logits.shape) != (*lead, config.vocab_size)
    ):
        raise ValueError(
            f"expected prev_tokens [R, γ], hidden [R, γ, d={config.hidden_size}], base_logits "
            f"[R, γ, V={config.vocab_size}]; got {lead}, {tuple(hidden.shape)}, "
            f"{tuple(base_logits.shape)}"
        )


class VanillaMarkovHead(_SequentialHeadBase):
    """Vanilla Markov head: b = W_up · W_down[x̂_{j-1}]; ignores h_j (d kept for uniformity)."""

    name = "vanilla-markov"
    correction_reads_previous_token_only = True

    def _correction(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.w_up(self.w_down(prev_tokens))  # [..., V]


class SiluMarkovHead(_SequentialHeadBase):
    """dspark's pre-reference vanilla head, b = W_up · SiLU(W_down[x̂_{j-1}]) (legacy checkpoints)."""

    name = "silu-markov"
    correction_reads_previous_token_only = True

    def _correction(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.w_up(F.silu(self.w_down(prev_tokens)))  # [..., V]


class GatedMarkovHead(_SequentialHeadBase):
    """Gated Markov head: g = σ(W_g [h_j ; W_down[x̂_{j-1}]]), b = W_up(g ⊙ W_down[x̂_{j-1}])."""

    name = "gated-markov"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256) -> None:
        super().__init__(vocab_size, hidden_size, rank)
        self.w_g = nn.Linear(hidden_size + rank, rank)  # [r, d + r]

    def _correction(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.w_down(prev_tokens)  # [..., r]
        g = torch.sigmoid(self.w_g(torch.cat([self._hidden(hidden), e], dim=-1)))  # [..., r]
        return self.w_up(g * e)  # [..., V]


class RNNHead(_SequentialHeadBase):
    """RNN head: a gated recurrence on s (size r) across positions, b = W_up(tanh(o)).

    (g, c, o) = W [s_{j-1} ; W_down[x̂_{j-1}] ; h_j], s_j = σ(g) ⊙ s_{j-1} + (1 − σ(g)) ⊙ tanh(c),
    s_0 = 0. ``step`` returns s_j as the state; ``state=None`` means s_0.
    """

    name = "rnn"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256) -> None:
        super().__init__(vocab_size, hidden_size, rank)
        self.w = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [3r, r + r + d]

    def _input_part(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """W[:, r:] [W_down[x̂_{j-1}] ; h_j] + bias, the part that does not read s: [..., 3r]."""
        r = self.config.rank
        x = torch.cat([self.w_down(prev_tokens), self._hidden(hidden)], dim=-1)  # [..., r + d]
        return F.linear(x, self.w.weight[:, r:], self.w.bias)

    def _cell(self, pre: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pre [R, 3r], s_{j-1} [R, r] → (tanh(o) [R, r], s_j [R, r])."""
        r = self.config.rank
        z = pre + F.linear(s, self.w.weight[:, :r])  # [R, 3r]
        g, c, o = z.chunk(3, dim=-1)  # [R, r] each
        keep = torch.sigmoid(g)
        return torch.tanh(o), keep * s + (1 - keep) * torch.tanh(c)

    def step(
        self,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: x̂_{j-1} [R], h_j [R, d], U_j [R, V], s_{j-1} [R, r] → (Ũ_j [R, V], s_j)."""
        pre = self._input_part(prev_tokens, hidden)  # [R, 3r]
        s = pre.new_zeros(pre.shape[0], self.config.rank) if state is None else state  # [R, r]
        out, s = self._cell(pre, s)
        return self._add(base_logits, self.w_up(out)), s

    def forward(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced: [R, γ], [R, γ, d], [R, γ, V] → Ũ [R, γ, V]; loops γ on r-sized state only."""
        _check_block(prev_tokens, hidden, base_logits, self.config)
        pre = self._input_part(prev_tokens, hidden)  # [R, γ, 3r]
        s = pre.new_zeros(pre.shape[0], self.config.rank)  # [R, r] s_0
        outs = []
        for j in range(pre.shape[1]):
            out, s = self._cell(pre[:, j], s)
            outs.append(out)
        return self._add(base_logits, self.w_up(torch.stack(outs, dim=1)))  # [R, γ, V]


_HEADS: dict[str, type[_SequentialHeadBase]] = {
    cls.name: cls for cls in (VanillaMarkovHead, GatedMarkovHead, RNNHead, SiluMarkovHead)
}


def build_head(kind: str, vocab_size: int, hidden_size: int, rank: int = 256) -> _SequentialHeadBase:
    """The sequential head ``kind`` ("vanilla-markov", "gated-markov" or "rnn"), W_up at zero."""
    return _SequentialHeadBase.from_config(HeadConfig(kind, vocab_size, hidden_size, rank))


# --------------------------------------------------------------------------------------------
# Confidence head
# --------------------------------------------------------------------------------------------


class ConfidenceHead(nn.Module):
    """Raw confidence logit_j = w · [h_j ; W_down[x̂_{j-1}]] + b; c_j = σ(logit_j).

    Takes the backbone state h_j [..., d] and the previous token's embedding prev_emb [..., r]
    (``head.prev_embedding(prev_tokens)``, sharing the sequential head's W_down) and returns
    logits [...]. It deliberately has no input for the draft token x̂_j: whether position j is
    verified must not depend on x̂_j (nor on later positions), or truncating the draft is not a
    stopping rule and verification is no longer lossless (docs/concepts.md §5).
    Trained with BCE against the detached overlap α_j; calibrate before scheduling.
    """

    def __init__(self, hidden_size: int, rank: int = 256) -> None:
        super().__init__()
        _require_positive("ConfidenceHead", "hidden_size", hidden_size)
        _require_positive("ConfidenceHead", "rank", rank)
        self.hidden_size, self.rank = hidden_size, rank
        self.proj = nn.Linear(hidden_size + rank, 1)  # [1, d + r]

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """h_j [..., d], W_down[x̂_{j-1}] [..., r] → raw logits [...]."""
        x = torch.cat([hidden.to(self.proj.weight.dtype), prev_emb.to(self.proj.weight.dtype)], -1)
        return self.proj(x).squeeze(-1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
