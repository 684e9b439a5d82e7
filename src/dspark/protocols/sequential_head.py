"""SequentialHead: the light per-step correction Ũ_j = U_j + b(x̂_{j-1}, h_j)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class SequentialHead(Protocol):
    """One cheap step per draft position, run γ-1 times per round after the parallel backbone.

    ``step`` takes the previous token x̂_{j-1} [R], the backbone state h_j [R, d], the base logits
    U_j [R, V] and the head's recurrent state (``None`` at j = 1), and returns the corrected logits
    Ũ_j [R, V] and the next state. ``forward`` is the teacher-forced form used in training: all
    positions in one tensor op, prev_tokens [R, γ], hidden [R, γ, d], base_logits [R, γ, V].
    """

    name: str

    def step(
        self,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        state: Any = None,
    ) -> tuple[torch.Tensor, Any]: ...

    def forward(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> torch.Tensor: ...
