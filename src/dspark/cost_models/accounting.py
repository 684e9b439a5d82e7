"""Accounting: which verification batch B a schedule costs, and the methods every cost model shares.

Terms (R requests, prefix lengths ℓ, B, α(R), packed / padded) are defined in
:mod:`dspark.cost_models`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ACCOUNTINGS",
    "admission_batch_sizes",
    "batch_overhead",
    "batch_size",
    "best_fixed_length",
    "best_length",
    "check_survival",
    "fixed_length_rates",
    "plain_step_seconds",
    "round_seconds",
    "undrafted_step_seconds",
]

ACCOUNTINGS = ("packed", "padded")


def _int_vector(name: str, value: object, minimum: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.ndim != 1:
        raise TypeError(f"{name} must be a 1-D torch.Tensor")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if value.numel() and int(value.min()) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got min {int(value.min())}")
    return value.long()


def batch_size(lengths: torch.Tensor, accounting: str) -> int:
    """B for prefix lengths ℓ [R]: packed Σ_r (1 + ℓ_r), padded R · (1 + max ℓ)."""
    lengths = _int_vector("lengths", lengths, minimum=0)  # [R]
    num_requests = lengths.numel()
    if accounting == "packed":
        return num_requests + int(lengths.sum())
    return num_requests * (1 + int(lengths.max())) if num_requests else 0


def admission_batch_sizes(
    num_requests: int, positions: torch.Tensor, accounting: str
) -> torch.Tensor:
    """B after each of K admissions of candidates at 1-based positions [K] → int64 [K + 1].

    Entry 0 is plain decoding (B = R). Packed: each admission adds one token, B_k = R + k.
    Padded: candidates of a request arrive in position order, so max ℓ after k admissions is the
    running maximum of the positions, B_k = R · (1 + max positions[:k]).
    """
    if not isinstance(num_requests, int) or isinstance(num_requests, bool) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
    positions = _int_vector("positions", positions, minimum=1)  # [K]
    if accounting == "packed":
        return num_requests + torch.arange(positions.numel() + 1)  # [K + 1]
    longest = torch.cummax(positions, dim=0).values if positions.numel() else positions  # [K]
    longest = torch.cat([positions.new_zeros(1), longest])  # [K + 1]
    return num_requests * (1 + longest)  # [K + 1]


def batch_overhead(cost_model: Any, num_requests: int) -> float:
    """α(R) of any cost model: its ``batch_overhead_seconds(R)`` when it has one (plugin cost
    models need not), else 0."""
    fn = getattr(cost_model, "batch_overhead_seconds", None)
    return float(fn(num_requests)) if fn is not None else 0.0


def round_seconds(cost_model: Any, batch_size: int, num_requests: int) -> float:
    """A whole verification step of R requests at batch B: t(B) + α(R)."""
    return float(cost_model.step_seconds(torch.tensor([batch_size]))[0]) + batch_overhead(cost_model, num_requests)


def undrafted_step_seconds(cost_model: Any, num_requests: int) -> float:
    """t(B₀) + α(R): the verification step of R requests verifying no drafts, as the cost model's
    step times price it (a profile's points: each shape timed after another)."""
    return round_seconds(cost_model, cost_model.batch_size(torch.zeros(num_requests, dtype=torch.long)), num_requests)


def plain_step_seconds(cost_model: Any, num_requests: int) -> float:
    """The cost model's plain decoding step of R requests: its ``plain_step_seconds(R)`` where it
    has one (a step run back to back, as plain decoding runs it, which on a CPU can be several
    per cent faster than the same step after another shape, as a drafted round's verification
    runs and as a profile's points are timed), else :func:`undrafted_step_seconds`."""
    fn = getattr(cost_model, "plain_step_seconds", None)
    if fn is not None:
        return float(fn(num_requests))
    return undrafted_step_seconds(cost_model, num_requests)


def check_survival(survival: Any) -> list[float]:
    """s_j = P(accepted ≥ j), j = 1..γ, as floats; raises unless non-increasing probabilities."""
    s = [float(v) for v in survival]
    if not s or any(not 0.0 <= v <= 1.0 for v in s) or any(b > a + 1e-12 for a, b in zip(s, s[1:])):
        raise ValueError(f"survival must be non-increasing probabilities s_1 ≥ s_2 ≥ ... in [0, 1], got {s}")
    return s


def fixed_length_rates(survival: Any, cost_model: Any, num_requests: int,
                       draft_seconds: float = 0.0, round_overhead: float = 0.0) -> list[float]:
    """Expected tokens / second at R requests all drafting k, for k = 0..γ (k = 0: plain decoding).

    ``survival`` s_j = P(accepted ≥ j), j = 1..γ; a round of R requests all drafting k commits
    R · (1 + Σ_{j≤k} s_j) tokens in t(B_k) + α(R) + ``round_overhead`` + ``draft_seconds`` (k > 0)
    seconds, B_k the cost model's batch for ℓ = k everywhere; plain decoding's step is
    :func:`plain_step_seconds` (back to back, where the cost model knows it).
    """
    s = [float(v) for v in survival]
    rates = []
    for k in range(len(s) + 1):
        B = cost_model.batch_size(torch.full((num_requests,), k, dtype=torch.long))
        step = round_seconds(cost_model, B, num_requests) if k else plain_step_seconds(cost_model, num_requests)
        t = step + round_overhead + (draft_seconds if k else 0.0)
        rates.append(num_requests * (1.0 + sum(s[:k])) / t)
    return rates


def best_length(rates: Any) -> tuple[int, float]:
    """(k*, rate) of the highest of ``rates`` [γ + 1] (:func:`fixed_length_rates`); a longer k must
    win by more than 1e-9 relative."""
    best_k, best = 0, -1.0
    for k, rate in enumerate(rates):
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k, best


def best_fixed_length(survival: Any, cost_model: Any, num_requests: int,
                      draft_seconds: float = 0.0, round_overhead: float = 0.0) -> tuple[int, float]:
    """The fixed draft length k ∈ 0..γ of highest expected throughput at R requests, and that rate."""
    return best_length(fixed_length_rates(survival, cost_model, num_requests, draft_seconds, round_overhead))


# --------------------------------------------------------------------------------------------
# Shared by the cost models
# --------------------------------------------------------------------------------------------


def batch_tensor(value: torch.Tensor) -> torch.Tensor:
    """Batch sizes B [K] as float64, checked finite and >= 0."""
    x = torch.as_tensor(value, dtype=torch.float64)
    if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
        raise ValueError("batch sizes must be finite and >= 0")
    return x


class Accounted:
    """The protocol methods shared by every cost model; subclasses give step_seconds."""

    __slots__ = ()
    accounting: str

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sps(self, batch_size: torch.Tensor) -> torch.Tensor:
        """Steps per second, 1 / step_seconds. [K] → [K] float64."""
        return 1.0 / self.step_seconds(batch_size)

    def batch_overhead_seconds(self, num_requests: int) -> float:
        """α(R): step time that depends on the number of requests, not on B (0 unless profiled)."""
        return 0.0

    def batch_size(self, lengths: torch.Tensor) -> int:
        """B for concrete prefix lengths ℓ [R] under this model's accounting."""
        return batch_size(lengths, self.accounting)

    def admission_batch_sizes(self, num_requests: int, positions: torch.Tensor) -> torch.Tensor:
        """B after admitting candidates at 1-based positions [K] one by one → [K + 1]."""
        return admission_batch_sizes(num_requests, positions, self.accounting)


def check_accounting(_inst: object, attribute: Any, value: object) -> None:
    if value not in ACCOUNTINGS:
        raise ValueError(f"{attribute.name} must be 'packed' or 'padded', got {value!r}")


def is_number(value: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
