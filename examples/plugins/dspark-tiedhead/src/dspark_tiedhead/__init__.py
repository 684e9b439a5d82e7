"""dspark-tiedhead: a sequential head that reuses the target's frozen embedding and LM head.

The built-in Markov heads learn their own token embedding W_down [V, r] and output map W_up
[V, r]: 2·V·r parameters, ~25 M for SmolLM2-135M at r = 256. ``tied-markov`` borrows both from
the target instead (E the token embedding [V, d], W the LM head [V, d], frozen, never saved) and
learns only three d×r maps::

    z_j = D · E[x̂_{j-1}]                          D [r, d]   (also the confidence head's input)
    g_j = σ(G · h_j + g_b)                          G [r, d]
    b_j = W · (U_r · (g_j ⊙ SiLU(z_j)))            U_r [d, r], zero-initialised
    Ũ_j = U_j + b_j

U_r starts at zero, so a fresh head is the identity correction Ũ = U (like the built-ins' W_up).
The correction is a d-sized nudge of the hidden state read out through the target's own LM head.

The head needs E and W before it can run: a DSpark drafter hands them over from its own
``bind_target`` (in the head's vocabulary order: with a reduced draft vocabulary, the rows of the
draft slots). Used unbound it raises a RuntimeError; bound to weights of the wrong shape (e.g. the
full [V, d] target matrices for a head over a V_d-token draft vocabulary) it raises a ValueError.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

import dspark

__version__ = "0.1.0"
__all__ = ["TiedHeadConfig", "TiedMarkovHead", "register_sequential_heads"]


def _positive(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"TiedMarkovHead.{what} must be a positive int, got {value!r}")


@frozen
class TiedHeadConfig:
    """Shape of the head: its kind, V (vocab_size, the draft vocabulary), d (hidden_size), r (rank)."""

    kind: str
    vocab_size: int
    hidden_size: int
    rank: int = 256


class TiedMarkovHead(nn.Module):
    """b = W · U_r(σ(G h_j) ⊙ SiLU(D E[x̂_{j-1}])), E and W the target's frozen embedding and LM head.

    Factory signature as the built-ins: ``(vocab_size, hidden_size, rank=256)``. Trainable
    parameters: D, G (+ bias) and U_r, 3·d·r + r in all, independent of V.
    """

    name: ClassVar[str] = "tied-markov"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256) -> None:
        super().__init__()
        for what, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("rank", rank)):
            _positive(what, value)
        self.config = TiedHeadConfig(self.name, vocab_size, hidden_size, rank)
        self.down = nn.Linear(hidden_size, rank, bias=False)  # D [r, d]
        self.gate = nn.Linear(hidden_size, rank)  # G [r, d], g_b [r]
        self.up = nn.Linear(rank, hidden_size, bias=False)  # U_r [d, r]
        nn.init.zeros_(self.up.weight)  # b ≡ 0 at initialisation: Ũ = U
        # Borrowed from the target by bind_target: plain attributes, so neither trained, saved in
        # state_dict nor copied by .to(dtype).
        self._embed: torch.Tensor | None = None  # E [V, d]
        self._lm_head: torch.Tensor | None = None  # W [V, d]

    # -- target binding -------------------------------------------------------------------
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> TiedMarkovHead:
        """Borrow E [V, d] and W [V, d], rows in this head's vocabulary order (draft slots)."""
        V, d = self.config.vocab_size, self.config.hidden_size
        for what, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if tuple(w.shape) != (V, d):
                raise ValueError(
                    f"tied-markov head: the target {what} has shape {tuple(w.shape)}, but this head "
                    f"works over V={V} tokens with hidden size d={d}; with a reduced draft vocabulary "
                    "pass the rows of the draft slots in slot order (a DSpark drafter's bind_target does)"
                )
        self._embed, self._lm_head = embed_weight.detach(), lm_head_weight.detach()
        return self

    @property
    def is_bound(self) -> bool:
        return self._embed is not None and self._lm_head is not None

    def _require_bound(self) -> None:
        if not self.is_bound:
            raise RuntimeError(
                "tied-markov head is not bound to a target: it reuses the target's token embedding "
                "and LM head; call head.bind_target(embed_weight, lm_head_weight) first (a DSpark "
                "drafter does this in its own bind_target)"
            )

    # -- the correction -------------------------------------------------------------------
    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """z = D · E[x̂_{j-1}]: [...] int64 → [..., r]. Also the confidence head's token input."""
        self._require_bound()
        e = F.embedding(prev_tokens, self._embed.to(prev_tokens.device))  # [..., d]
        return self.down(e.to(self.down.weight.dtype))  # [..., r]

    def _correction(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """b(x̂_{j-1}, h_j) for any leading shape: [...], [..., d] → [..., V]."""
        z = self.prev_embedding(prev_tokens)  # [..., r]
        g = torch.sigmoid(self.gate(hidden.to(self.gate.weight.dtype)))  # [..., r]
        u = self.up(g * F.silu(z))  # [..., d]
        W = self._lm_head.to(u.device)
        return F.linear(u.to(W.dtype), W)  # [..., V]

    @staticmethod
    def _add(base_logits: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return base_logits + b.to(base_logits.dtype)

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
        c, lead = self.config, tuple(prev_tokens.shape)
        if tuple(hidden.shape) != (*lead, c.hidden_size) or tuple(base_logits.shape) != (*lead, c.vocab_size):
            raise ValueError(
                f"expected prev_tokens [R, γ], hidden [R, γ, d={c.hidden_size}], base_logits "
                f"[R, γ, V={c.vocab_size}]; got {lead}, {tuple(hidden.shape)}, {tuple(base_logits.shape)}"
            )
        return self._add(base_logits, self._correction(prev_tokens, hidden))

    # -- bookkeeping ----------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Trainable parameters (the borrowed E and W are not counted): 3·d·r + r."""
        return sum(p.numel() for p in self.parameters())

    def num_shared_parameters(self) -> int:
        """Target weights read but not owned: E and W, 2·V·d (one matrix if the target ties them)."""
        return 2 * self.config.vocab_size * self.config.hidden_size

    def extra_repr(self) -> str:
        c = self.config
        return f"V={c.vocab_size}, d={c.hidden_size}, r={c.rank}, bound={self.is_bound}"


@dspark.hookimpl
def register_sequential_heads(register):
    register(
        "tied-markov",
        TiedMarkovHead,
        description="Markov head reusing the target's frozen embedding and LM head: 3·d·r + r parameters",
    )
