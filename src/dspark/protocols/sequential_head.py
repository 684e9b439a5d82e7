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
    ``prev_embedding(prev_tokens [...]) → [..., r]`` is the previous-token embedding the DSpark
    confidence head reads. A head that reuses the target's weights also satisfies
    :class:`TargetBoundHead`.
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

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TargetBoundHead(Protocol):
    """A sequential head that borrows the target's embedding / LM head (in draft-slot order):
    the drafter calls ``bind_target`` from its own ``bind_target``."""

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> Any: ...
