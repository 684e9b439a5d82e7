"""CostModel: the hardware's verification speed SPS(B) and how a schedule maps to B."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CostModel(Protocol):
    """Verification steps per second as a function of the verification batch B (tokens).

    ``accounting`` is ``"packed"`` (B = Σ_r (1 + ℓ_r)) or ``"padded"`` (B = R · (1 + max ℓ)): the
    engine's real verification shape, which the cost model — not the scheduler — owns.
    Optional, read where present: ``batch_overhead_seconds(R)`` (α(R), see
    :func:`dspark.cost_models.round_seconds`) and ``plain_step_seconds(R)`` (plain decoding's
    step, see :func:`dspark.cost_models.plain_step_seconds`).
    """

    name: str
    accounting: str

    def sps(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Steps per second at each batch size. [K] int/float → [K] float."""
        ...

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Seconds per verification step, 1 / SPS. [K] → [K] float."""
        ...

    def batch_size(self, lengths: torch.Tensor) -> int:
        """B for concrete prefix lengths ℓ [R]."""
        ...

    def admission_batch_sizes(self, num_requests: int, positions: torch.Tensor) -> torch.Tensor:
        """B after admitting candidates one by one.

        ``positions`` [K] are the 1-based draft positions j of the candidates in admission order;
        returns [K + 1] batch sizes, entry k after the first k admissions (entry 0 is plain
        decoding, ℓ = 0).
        """
        ...


@runtime_checkable
class ContextAwareCostModel(Protocol):
    """A cost model whose step time depends on the KV context the batch attends to.

    ``at_context(context, num_requests)`` returns the model for a batch whose requests hold
    ``context`` tokens of KV cache on average (an immutable value: the engine asks once per round,
    models round the context so that consecutive rounds share one bound model).
    """

    def at_context(self, context: float, num_requests: int | None = None) -> CostModel: ...
