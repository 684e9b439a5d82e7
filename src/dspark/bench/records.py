"""What a serving benchmark records, and the metrics computed from it — shared by measured and
simulated runs so both are summarised by the same code.

Terms (per concurrency level and scheduler): a *round* is one engine step over the R active
requests; ℓ_r the verified draft length, B the verification batch under the cost model's
accounting. τ = committed tokens per request-round, mean(accepted + 1); ℓ̄ = mean ℓ over
request-rounds; throughput = output tokens / makespan; per-user rate = mean over requests of
output tokens / (finish − admission); latencies are measured from arrival (TTFT includes queueing).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from attrs import define, field, frozen

from dspark import serialization

__all__ = ["RoundRecord", "RequestRecord", "LevelRun", "summarise_run", "percentile"]


@frozen
class RoundRecord:
    start: float  # seconds since the level started
    seconds: float
    num_requests: int  # R
    verified: int  # Σ_r ℓ_r
    max_verified: int  # max_r ℓ_r
    batch_size: int  # B
    accepted: int  # Σ_r accepted_r
    drafted: bool
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    context: float = 0.0  # mean KV context per request (tokens); 0: not recorded (older runs)


@define
class RequestRecord:
    request_id: str
    arrival: float
    admitted: float = math.nan
    prefill_seconds: float = 0.0
    first_token: float = math.nan
    finished: float = math.nan
    new_tokens: int = 0
    rounds: int = 0


@define
class LevelRun:
    """One scheduler at one concurrency level: every round and every request."""

    scheduler: str
    concurrency: int
    arrival: str  # "closed" | "poisson"
    rate: float | None  # requests / s (poisson)
    makespan: float
    rounds: list[RoundRecord] = field(factory=list)
    requests: list[RequestRecord] = field(factory=list)
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return serialization.to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LevelRun:
        return serialization.from_dict(cls, d, rounds=[RoundRecord(**r) for r in d["rounds"]],
                                       requests=[RequestRecord(**r) for r in d["requests"]])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0–100) of the non-nan values (numpy's); nan for none."""
    xs = np.asarray(values, dtype=float)
    xs = xs[~np.isnan(xs)]
    return float(np.percentile(xs, q)) if xs.size else math.nan


def summarise_run(run: LevelRun) -> dict[str, Any]:
    """The per-level metrics (module docstring) of one run."""
    reqs, rounds = run.requests, run.rounds
    tokens = sum(r.new_tokens for r in reqs)
    request_rounds = sum(r.num_requests for r in rounds)
    e2e = [r.finished - r.arrival for r in reqs]
    ttft = [r.first_token - r.arrival for r in reqs]
    tpot = [(r.finished - r.first_token) / (r.new_tokens - 1) for r in reqs if r.new_tokens > 1]
    rate = [r.new_tokens / (r.finished - r.admitted) for r in reqs if r.finished > r.admitted]
    n = max(len(rounds), 1)
    return {
        "scheduler": run.scheduler, "concurrency": run.concurrency, "arrival": run.arrival,
        "requests": len(reqs), "output_tokens": tokens, "makespan_s": run.makespan,
        "throughput_tok_s": tokens / run.makespan if run.makespan > 0 else math.nan,
        "per_user_tok_s": sum(rate) / len(rate) if rate else math.nan,
        "tau": (sum(r.accepted for r in rounds) + request_rounds) / max(request_rounds, 1),
        "mean_verified": sum(r.verified for r in rounds) / max(request_rounds, 1),
        "mean_batch": sum(r.batch_size for r in rounds) / n,
        "mean_active": request_rounds / n,
        "drafted_fraction": sum(r.drafted for r in rounds) / n,
        "step_ms": 1e3 * sum(r.seconds for r in rounds) / n,
        "draft_ms": 1e3 * sum(r.draft_seconds for r in rounds) / n,
        "latency_p50_s": percentile(e2e, 50), "latency_p90_s": percentile(e2e, 90),
        "latency_p99_s": percentile(e2e, 99),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
        "simulated": run.simulated,
    }
