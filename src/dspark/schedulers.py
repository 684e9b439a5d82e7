"""Verification schedulers: how many draft tokens of each request to verify.

Terms, once (docs/concepts.md §2–5). R requests, block size γ. c_{r,j} ∈ [0, 1] is the calibrated
probability that draft position j is accepted given positions < j were; a_{r,j} = Π_{i≤j} c_{r,i}
the prefix survival. A schedule picks ℓ_r (0 ≤ ℓ_r ≤ valid_r ≤ γ). Expected committed tokens
τ(ℓ) = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}); verification batch B(ℓ) under the cost model's accounting;
expected throughput Θ = τ · SPS(B), or τ / (t(B) + α(R)) when the cost model profiles a
per-request overhead α(R) (``batch_overhead_seconds``: constant across one round's choices, but
it makes the ratio less steep, so dropping it would over-trim). ``sps-greedy:sunk=true`` also counts
s, the round's seconds already spent when it schedules (drafting, confidence, calibration):
Θ = τ / (s + t(B) + α(R)), the round's own tokens per second (:class:`SunkCost`).

A scheduler returns the lengths ℓ [R] (``lengths(c, valid, cost_model)``); the framework checks
them and builds the :class:`~dspark.types.Schedule` with τ, B and Θ (:func:`build_schedule`), so no
scheduler — built-in or a plugin's — repeats survival → summarise → Schedule.

Losslessness: a schedule may be used with rejection sampling only if it is a *stopping rule* —
the decision "verify position j" depends on c_{r,1..j} and on other requests, never on
c_{r,j+1..γ} (which read x̂_j). Every scheduler states it in ``lossless``; ``sps-argmax`` is the
global-argmax variant that looks ahead and is *not* lossless (docs/concepts.md §5).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from attrs import field, frozen, validators

from dspark.cost_models import batch_overhead
from dspark.protocols.cost_model import CostModel
from dspark.types import Schedule

__all__ = [
    "build_schedule",
    "SchedulerBase",
    "FullScheduler",
    "FixedScheduler",
    "ThresholdScheduler",
    "SPSGreedyScheduler",
    "SPSArgmaxScheduler",
    "LossyScheduleWarning",
    "SunkCost",
    "with_sunk_seconds",
    "survival",
    "sps_greedy_lengths",
    "OneRequestAdmission",
    "summarise",
]


class LossyScheduleWarning(UserWarning):
    """The scheduler is not a stopping rule: outputs will NOT follow the target's distribution."""


# --------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------


def _check_inputs(
    confidence: torch.Tensor, valid_lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(confidence, torch.Tensor) or confidence.ndim != 2:
        raise ValueError("confidence must be a [R, γ] tensor of per-step probabilities c_{r,j}")
    c = confidence.float()  # [R, γ]
    if c.numel() and not (0.0 <= float((mm := torch.aminmax(c)).min) and float(mm.max) <= 1.0):
        raise ValueError(
            "confidence must hold calibrated probabilities in [0, 1] (pass raw logits through a "
            "Calibrator first)"
        )
    R, gamma = c.shape
    if valid_lengths is None:
        return c, torch.full((R,), gamma, dtype=torch.long)
    v = valid_lengths.long()
    if v.shape != (R,) or (R and (int(v.min()) < 0 or int(v.max()) > gamma)):
        raise ValueError(f"valid_lengths must be [R={R}] with values in [0, γ={gamma}]")
    return c, v


def survival(confidence: torch.Tensor, valid_lengths: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = Π_{i≤j} c_{r,i}, zero beyond valid_r. [R, γ], [R] → [R, γ]."""
    gamma = confidence.shape[1]
    a = torch.cumprod(confidence, dim=1)  # [R, γ]
    return a * (torch.arange(gamma)[None, :] < valid_lengths[:, None])


def summarise(
    a: torch.Tensor, lengths: torch.Tensor, cost_model: CostModel | None
) -> tuple[float, int, float]:
    """τ, B, Θ for prefix lengths ℓ [R] given survival a [R, γ].

    Without a cost model B is the packed count and Θ is nan.
    """
    R, gamma = a.shape
    verified = torch.arange(gamma)[None, :] < lengths[:, None]  # [R, γ]
    tau = float(R + (a * verified).sum())
    if cost_model is None:
        return tau, int(R + lengths.sum()), math.nan
    B = int(cost_model.batch_size(lengths))
    theta = float(_throughput(np.array([tau]), np.array([B]), R, cost_model)[0])
    return tau, B, theta


@frozen
class SunkCost:
    """``base`` with the round's ``sunk_seconds`` s added to its per-round overhead α(R).

    Why: the drafter ran before the schedule is chosen, so its time is part of the round whatever
    ℓ is; the round's real rate is τ / (s + t(B) + α(R)). Leaving s out (the paper's Θ) overstates
    the rate a marginal token must beat by (s + t) / t — 2× where drafting costs as much as a
    verification step — so the early break stops short of drafts
    that would pay. Everything else (SPS, accounting, B) is ``base``'s.
    """

    base: Any
    sunk_seconds: float = field(converter=float, validator=validators.ge(0.0))

    def __getattr__(self, name: str) -> Any:  # step_seconds, sps, accounting, batch_size, ...
        return getattr(self.base, name)

    def batch_overhead_seconds(self, num_requests: int) -> float:
        return batch_overhead(self.base, num_requests) + self.sunk_seconds


def with_sunk_seconds(scheduler: Any, cost_model: Any, seconds: float) -> Any:
    """The cost model a scheduler sees after ``seconds`` of the round were spent: wrapped in
    :class:`SunkCost` for a scheduler that counts them (``sunk`` true), else unchanged."""
    if cost_model is None or not getattr(scheduler, "sunk", False):
        return cost_model
    return SunkCost(cost_model, max(float(seconds), 0.0))


def _throughput(tau: np.ndarray, B: np.ndarray, R: int, cost_model: CostModel) -> np.ndarray:
    """Θ = τ / (t(B) + α(R)) = τ · SPS(B) when there is no per-request overhead."""
    # SPS is tabulated per base model: a SunkCost is new every round
    sps = _SPS_CACHE.lookup(cost_model.base if isinstance(cost_model, SunkCost) else cost_model, B)
    return _theta(tau, sps, batch_overhead(cost_model, R))


def _theta(tau: Any, sps: Any, overhead: float) -> Any:
    """Θ from τ, SPS(B) and α(R) (arrays or scalars alike, the same operations either way)."""
    return tau * sps if overhead == 0.0 else tau / (1.0 / sps + overhead)


class _SPSCache:
    """SPS(B) tabulated over integer B per cost model, so a schedule costs one gather.

    Cost models are immutable values, so a table stays valid; it grows when a larger B is asked
    for. Holding the model itself keeps ``id`` from being reused.
    """

    def __init__(self) -> None:
        self._tables: dict[int, tuple[CostModel, np.ndarray]] = {}

    def lookup(self, cost_model: CostModel, B: np.ndarray) -> np.ndarray:
        entry = self._tables.get(id(cost_model))
        need = int(B.max()) + 1
        if entry is None or entry[1].shape[0] < need:
            size = max(need, 2 * entry[1].shape[0] if entry else 1024)
            try:
                table = cost_model.sps(torch.arange(size)).double().numpy()  # [size]
            except ValueError:  # a model that refuses to extrapolate: tabulate only what is asked
                table = cost_model.sps(torch.arange(need)).double().numpy()  # [need]
            if len(self._tables) >= 8:
                self._tables.clear()
            self._tables[id(cost_model)] = entry = (cost_model, table)
        return entry[1][B]


_SPS_CACHE = _SPSCache()


def _admission_curve(
    a: np.ndarray, valid_lengths: np.ndarray, cost_model: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (r, j) sorted by a descending, and τ, B, Θ after each admission.

    a [R, γ] float64, valid_lengths [R]. Returns order [Rγ] (flat indices r·γ + j−1), tau [Rγ+1],
    B [Rγ+1], theta [Rγ+1]; entry k is the state after admitting the first k candidates.
    Candidates beyond valid_r sort last and get Θ = −inf. The sort is stable and flat indices are
    position-major within a request, so ties keep j before j+1 and every admitted set is a union
    of per-request prefixes. NumPy, because at these sizes per-op overhead dominates.
    """
    R, gamma = a.shape
    valid = np.arange(gamma)[None, :] < valid_lengths[:, None]  # [R, γ]
    key = np.where(valid, a, -1.0).ravel()  # [Rγ] invalid positions sort after every valid one
    order = np.argsort(-key, kind="stable")  # [Rγ]
    sorted_a = np.maximum(key[order], 0.0)  # [Rγ]
    tau = R + np.concatenate(([0.0], np.cumsum(sorted_a)))  # [Rγ+1]
    positions = order % gamma + 1  # [Rγ] 1-based j
    if cost_model.accounting == "packed":
        B = R + np.arange(R * gamma + 1)  # [Rγ+1]
    elif cost_model.accounting == "padded":
        B = R * (1 + np.concatenate(([0], np.maximum.accumulate(positions))))  # [Rγ+1]
    else:
        B = cost_model.admission_batch_sizes(R, torch.from_numpy(positions)).numpy()
    theta = _throughput(tau, B, R, cost_model)  # [Rγ+1]
    theta[int(valid_lengths.sum()) + 1 :] = -np.inf
    return order, tau, B, theta


def _admitted_before_first_non_rise(theta: np.ndarray) -> int:
    """K: how many candidates SPS-greedy admits along an admission curve Θ [Rγ+1] — every one
    that raised Θ, up to (not including) the first that did not."""
    rises = theta[1:] > theta[:-1]  # [Rγ]
    return int(np.argmin(rises)) if not rises.all() else rises.size


def _lengths_from_admitted(order: np.ndarray, K: int, R: int, gamma: int) -> torch.Tensor:
    return torch.from_numpy(np.bincount(order[:K] // gamma, minlength=R).astype(np.int64))  # [R]


def sps_greedy_lengths(
    confidence: torch.Tensor,
    valid_lengths: torch.Tensor,
    cost_model: CostModel,
) -> tuple[torch.Tensor, torch.Tensor, float, int, float]:
    """SPS-greedy: admit (r, j) in descending a; stop at the first that does not raise Θ.

    confidence c [R, γ], valid_lengths [R] → (ℓ [R], a [R, γ], τ, B, Θ). O(Rγ log Rγ), no Python
    loop. The early break makes it a stopping rule: (r, j) is decided before (r, j+1) is looked at.
    """
    R, gamma = confidence.shape
    a = survival(confidence, valid_lengths)  # [R, γ]
    order, tau, B, theta = _admission_curve(a.double().numpy(), valid_lengths.numpy(), cost_model)
    K = _admitted_before_first_non_rise(theta)
    lengths = _lengths_from_admitted(order, K, R, gamma)
    return lengths, a, float(tau[K]), int(B[K]), float(theta[K])


class OneRequestAdmission:
    """SPS-greedy's decision on position j at one request, asked after each of the head's steps
    with c_1..j [1, j] (:func:`dspark.round.schedule_stop`): is position j verified?

    At one request the admission order is the position order (a_j = Π_{i≤j} c_i never rises, ties
    keep j before j + 1), so position j is verified iff Θ rose at each of the admissions 1..j. The
    rule carries τ and Θ of the prefix from one call to the next instead of building the admission
    curve again (a step's decision in scalar arithmetic instead of ~20 array operations), with
    :func:`_admission_curve`'s operations in its order: a_j from the float32 cumulative product as
    :func:`survival` computes it, τ_k = 1 + Σ_{i≤k} a_i in float64, Θ_k from the same SPS table, so
    it decides exactly as :func:`sps_greedy_lengths` on the whole block. A call whose c does not
    extend the last call's prefix starts again from position 1.
    """

    def __init__(self, valid: int, cost_model: CostModel) -> None:
        self.valid = int(valid)
        positions = torch.arange(1, self.valid + 1)  # [valid] the admission order at one request
        B = cost_model.admission_batch_sizes(1, positions).numpy()  # [valid + 1]
        base = cost_model.base if isinstance(cost_model, SunkCost) else cost_model
        self.sps = _SPS_CACHE.lookup(base, B)  # [valid + 1] SPS(B_k)
        self.overhead = batch_overhead(cost_model, 1)
        self._start()

    def _start(self) -> None:
        """Nothing admitted: k = 0."""
        self.seen: list[float] = []  # c_1..k of the prefix decided so far
        self.sum = 0.0  # Σ_{i≤k} a_i
        self.theta = self._theta(0)  # Θ_k
        self.rising = True  # Θ rose at admissions 1..k

    def _theta(self, k: int) -> float:
        return _theta(1 + self.sum, self.sps[k], self.overhead)

    def __call__(self, c: torch.Tensor) -> bool:
        """c_1..j [1, j] calibrated → whether position j is verified."""
        j = c.shape[1]
        if j > self.valid:
            return False
        values = c[0].tolist()
        if len(self.seen) != j - 1 or values[:-1] != self.seen:  # not the next position: start again
            self._start()
            for k in range(1, j):
                self._admit(c[:, :k], k)
        return self._admit(c, j)

    def _admit(self, c: torch.Tensor, k: int) -> bool:
        a_k = float(torch.cumprod(c.float(), dim=1)[0, k - 1])  # as survival() computes it
        self.sum += max(a_k, 0.0)
        theta = self._theta(k)
        self.rising = self.rising and theta > self.theta
        self.theta = theta
        self.seen.append(float(c[0, k - 1]))
        return self.rising


# --------------------------------------------------------------------------------------------
# Scheduler classes (thin wrappers, registered through the plugin hooks)
# --------------------------------------------------------------------------------------------


def build_schedule(
    scheduler: Any, confidence: torch.Tensor, valid_lengths: torch.Tensor | None = None,
    cost_model: CostModel | None = None,
) -> Schedule:
    """The framework's half of scheduling: check the inputs, ask ``scheduler.lengths`` for ℓ [R],
    check ℓ_r ∈ [0, valid_r] (a plugin's answer included), and build the Schedule (τ, B, Θ)."""
    c, v = _check_inputs(confidence, valid_lengths)  # [R, γ], [R]
    name = getattr(scheduler, "name", type(scheduler).__name__)
    lengths = scheduler.lengths(c, v, cost_model)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.shape != v.shape:
        got = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__qualname__
        raise TypeError(f"scheduler {name!r} must return integer lengths ℓ of shape [R={v.shape[0]}], got {got}")
    lengths = lengths.long()
    if bool((lengths < 0).any()) or bool((lengths > v).any()):
        raise ValueError(f"scheduler {name!r} returned lengths {lengths.tolist()}; each must lie in "
                         f"[0, valid draft length] = {[[0, int(x)] for x in v]}")
    a = survival(c, v)  # [R, γ]
    tau, B, theta = summarise(a, lengths, cost_model)
    return Schedule(lengths, a, tau, B, theta)


class SchedulerBase:
    """``schedule(...)`` for a scheduler that implements ``lengths(c, valid, cost_model)``."""

    def schedule(self, confidence: torch.Tensor, valid_lengths: torch.Tensor | None = None,
                 cost_model: CostModel | None = None) -> Schedule:
        return build_schedule(self, confidence, valid_lengths, cost_model)


@frozen
class FullScheduler(SchedulerBase):
    """Verify every valid draft token (the classic speculative-decoding schedule)."""

    name = "full"
    lossless = True
    stateless = True

    def lengths(self, c: torch.Tensor, valid: torch.Tensor, cost_model: CostModel | None = None) -> torch.Tensor:
        return valid

    def position_rule(self, valid: int, cost_model: CostModel | None = None) -> Callable[[torch.Tensor], bool]:
        return lambda c: c.shape[1] <= valid  # c [1, j]


@frozen
class FixedScheduler(SchedulerBase):
    """Verify the first k draft tokens (MTP-k style); k = 0 is plain decoding."""

    name = "fixed"
    lossless = True
    stateless = True
    k: int = field(default=1, validator=[validators.instance_of(int), validators.ge(0)])

    def lengths(self, c: torch.Tensor, valid: torch.Tensor, cost_model: CostModel | None = None) -> torch.Tensor:
        return valid.clamp(max=self.k)

    def position_rule(self, valid: int, cost_model: CostModel | None = None) -> Callable[[torch.Tensor], bool]:
        return lambda c: c.shape[1] <= min(self.k, valid)  # c [1, j]


@frozen
class ThresholdScheduler(SchedulerBase):
    """Verify while the confidence stays at or above a static threshold.

    ``mode="step"`` thresholds the per-step c_{r,j} (stop at the first c_j < threshold);
    ``mode="survival"`` thresholds the cumulative a_{r,j}. Both are stopping rules.
    """

    name = "threshold"
    lossless = True
    stateless = True
    threshold: float = field(default=0.5, validator=[validators.ge(0.0), validators.le(1.0)])
    mode: str = field(default="step", validator=validators.in_(("step", "survival")))

    def lengths(self, c: torch.Tensor, valid: torch.Tensor, cost_model: CostModel | None = None) -> torch.Tensor:
        score = c if self.mode == "step" else survival(c, valid)  # [R, γ]
        keep = (score >= self.threshold) & (torch.arange(c.shape[1])[None, :] < valid[:, None])
        return torch.cumprod(keep.long(), dim=1).sum(dim=1)  # [R]

    def position_rule(self, valid: int, cost_model: CostModel | None = None) -> Callable[[torch.Tensor], bool]:
        def verified(c: torch.Tensor) -> bool:  # c [1, j]
            j = c.shape[1]
            return j <= valid and int(self.lengths(c.float(), torch.tensor([j]))[0]) == j

        return verified


def _require_cost_model(name: str, cost_model: CostModel | None) -> CostModel:
    if cost_model is None:
        raise ValueError(f"scheduler {name!r} needs a cost model (e.g. 'sps-table' or 'roofline')")
    return cost_model


@frozen
class SPSGreedyScheduler(SchedulerBase):
    """Hardware-aware prefix scheduling: maximise Θ = τ · SPS(B) greedily, with the early break.

    At low load SPS is flat and long drafts are verified; at saturation the schedule degrades to
    MTP-1-like (ℓ ≤ 1) or plain decoding (ℓ = 0). Lossless (a stopping rule).

    ``lag`` > 0 is the paper's asynchronous variant, for engines that schedule a step ahead: the
    verification *budget* K (how many draft tokens the batch verifies) is the one sps-greedy chose
    from the confidences ``lag`` rounds earlier, and the *allocation* of those K tokens follows
    the current survivals (the K largest a_{r,j} of this round, ties by position). Lossless too:
    K does not read this round's confidences, and whether a_{r,j} is among the K largest never
    depends on a_{r,j+1..} ≤ a_{r,j}. The first ``lag`` rounds (no budget yet) are synchronous.
    The scheduler then keeps the last ``lag`` budgets: use one instance per engine.

    ``sunk`` = True (a named variant, not the paper's Θ): the round's seconds already spent when it
    schedules — drafting, confidence, calibration, measured by the round — join the denominator,
    Θ = τ / (s + t(B) + α(R)) (:class:`SunkCost`). Where drafting costs about a verification step
    (R = 1 on a CPU) the paper's Θ trims drafts that the round would verify almost for free.
    Still a stopping rule: s is known before any position is looked at.
    """

    name = "sps-greedy"
    lossless = True
    lag: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0), validators.le(8)])
    sunk: bool = field(default=False, validator=validators.instance_of(bool))
    _budgets: deque = field(init=False, factory=deque, repr=False, eq=False)  # K of the last `lag` rounds

    @property
    def stateless(self) -> bool:
        """Without ``lag`` (which keeps earlier rounds' budgets) or ``sunk`` (which reads the round's
        clock), ``lengths`` reads only its arguments (:func:`dspark.round.schedule_stop`)."""
        return self.lag == 0 and not self.sunk

    def lengths(self, c: torch.Tensor, valid: torch.Tensor, cost_model: CostModel | None = None) -> torch.Tensor:
        cm = _require_cost_model(self.name, cost_model)
        if self.lag == 0:
            return sps_greedy_lengths(c, valid, cm)[0]
        R, gamma = c.shape
        order, _tau, _B, theta = _admission_curve(survival(c, valid).double().numpy(), valid.numpy(), cm)
        self._budgets.append(_admitted_before_first_non_rise(theta))  # this round's K
        if len(self._budgets) <= self.lag:  # no budget from `lag` rounds ago yet: synchronous
            return _lengths_from_admitted(order, self._budgets[-1], R, gamma)
        K = min(self._budgets.popleft(), int(valid.sum()))  # chosen `lag` rounds ago
        return _lengths_from_admitted(order, K, R, gamma)

    def position_rule(self, valid: int, cost_model: CostModel | None = None) -> OneRequestAdmission:
        """At one request of valid length ``valid`` (and ``lag`` 0): the rule that says, step by step,
        whether position j is verified given c_1..j (:class:`OneRequestAdmission`)."""
        return OneRequestAdmission(valid, _require_cost_model(self.name, cost_model))


@frozen
class SPSArgmaxScheduler(SchedulerBase):
    """NOT LOSSLESS. Global argmax of Θ over all admission prefixes (no early break).

    It looks past the first non-improving candidate, so whether (r, j) is verified can depend on
    c_{r,j+1}, which reads x̂_j: the committed tokens are then biased (docs/concepts.md §5 gives a
    (0.7, 0.3) target that comes out as (0.85, 0.15)). Offered only to study that bias; it warns
    with :class:`LossyScheduleWarning` when built.
    """

    name = "sps-argmax"
    lossless = False

    def __attrs_post_init__(self) -> None:
        warnings.warn(
            "scheduler 'sps-argmax' is NOT lossless: outputs will not follow the target's "
            "distribution; use 'sps-greedy' for serving",
            LossyScheduleWarning,
            stacklevel=3,
        )

    def lengths(self, c: torch.Tensor, valid: torch.Tensor, cost_model: CostModel | None = None) -> torch.Tensor:
        cm = _require_cost_model(self.name, cost_model)
        R, gamma = c.shape
        order, _tau, _B, theta = _admission_curve(survival(c, valid).double().numpy(), valid.numpy(), cm)
        return _lengths_from_admitted(order, int(np.argmax(theta)), R, gamma)
