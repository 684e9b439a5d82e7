"""Reading a cost model at each round's KV context, shared by the engine and the simulator.

Verification cost grows with the context the batch attends to (on this CPU a 64-request step costs
94 ms over 64 tokens of context and 147 ms over 128). A :class:`ContextAwareCostModel` answers
``at_context(context, R)`` with a bound copy; :class:`ContextBinding` asks it once per 16-token
bucket of the round's mean context per request and number of requests R (the roofline's KV read,
R · context · KV bytes, depends on both) and keeps the answers, so that consecutive rounds at the
same load share one bound model (the scheduler and the draft gate read the same one).
"""

from __future__ import annotations

from typing import Any

from dspark.protocols.cost_model import ContextAwareCostModel

__all__ = ["CONTEXT_BUCKET", "ContextBinding", "context_bucket"]

CONTEXT_BUCKET = 16  # tokens: contexts are rounded to this before a model is bound


def context_bucket(context: float) -> int:
    """``context`` rounded to the nearest multiple of :data:`CONTEXT_BUCKET` tokens: consecutive
    rounds share one bound model."""
    return int(CONTEXT_BUCKET * round(float(context) / CONTEXT_BUCKET))


class ContextBinding:
    """``binding(context, num_requests)`` → the cost model at that mean context per request and
    that number of requests (a context-aware model's bound copy, memoised by (context bucket, R);
    any other model, or ``None``, as it is)."""

    def __init__(self, cost_model: Any, max_entries: int = 256) -> None:
        self.cost_model = cost_model
        self.max_entries = max_entries
        self._bound: dict[tuple[int, int | None], Any] = {}  # (context bucket, R) → bound model

    @property
    def context_aware(self) -> bool:
        return isinstance(self.cost_model, ContextAwareCostModel)

    def __call__(self, context: float, num_requests: int | None) -> Any:
        if not self.context_aware:
            return self.cost_model
        bucket = context_bucket(context)
        requests = None if num_requests is None else int(num_requests)
        key = (bucket, requests)
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= self.max_entries:
                self._bound.clear()
            bound = self._bound[key] = self.cost_model.at_context(bucket, requests)
        return bound
