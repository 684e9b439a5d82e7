"""Running a workload through the engine at one concurrency level, recording every round.

Arrivals: ``closed`` — a closed loop of ``concurrency`` users, each sending its next request as
soon as the previous one finishes (all requests queued at t = 0, at most ``concurrency`` active);
``poisson`` — requests arrive at exponential gaps of mean 1 / ``rate`` and wait in a FIFO queue
while ``concurrency`` requests are active (vLLM's ``--request-rate`` / ``--max-concurrency``).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from attrs import frozen

from dspark.bench.records import LevelRun, RequestRecord, RoundRecord

__all__ = ["ARRIVALS", "SchedulerSpec", "arrival_times", "parse_scheduler_spec", "run_level", "run_order"]

ARRIVALS = ("closed", "poisson")


@frozen
class SchedulerSpec:
    """A benchmark entry: ``plain`` (no drafter) or a registered scheduler with its config."""

    label: str
    name: str  # "plain" or a scheduler name in the registry
    config: dict[str, Any]

    @property
    def plain(self) -> bool:
        return self.name == "plain"


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_scheduler_spec(spec: str) -> SchedulerSpec:
    """``NAME[:KEY=VALUE,...]`` → SchedulerSpec, e.g. ``fixed:k=1``, ``threshold:threshold=0.3``."""
    name, _, rest = spec.strip().partition(":")
    config = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"scheduler spec {spec!r}: expected NAME[:KEY=VALUE,...], got item {item!r}")
        config[key.strip()] = _value(value.strip())
    if not name:
        raise ValueError(f"scheduler spec {spec!r} has no scheduler name")
    if name == "plain" and config:
        raise ValueError("the 'plain' baseline takes no configuration")
    return SchedulerSpec(spec.strip(), name, config)


def build_lossless(spec: SchedulerSpec, why: str) -> Any:
    """The scheduler of a non-plain ``spec``; a lossy one is refused with ``why`` losslessness is needed."""
    import dspark

    scheduler = dspark.get_scheduler(spec.name, **spec.config)
    if not getattr(scheduler, "lossless", False):
        raise ValueError(f"scheduler {spec.label!r} is not lossless; {why}")
    return scheduler


def run_order(n: int, repeat: int) -> list[int]:
    """The order in which repeat ``repeat`` runs n schedulers: a row of a Williams design. For even
    n, over n repeats each scheduler runs once at every position (fair under slow drift, as a
    rotation is) and directly after every other scheduler exactly once; for odd n the same holds
    over 2n repeats (each row followed by its mirror image). A rotation keeps each scheduler's
    predecessor fixed, so whatever a run leaves behind (a heavy drafting run's heap, a warm cache)
    would bias the same ratio in every repeat: in bench32 sps-greedy ran right after threshold (the
    largest verification batches) in all three repeats (docs/serving.md)."""
    if n < 1:
        raise ValueError(f"need at least one scheduler, got {n}")
    # 0, 1, n-1, 2, n-2, ...: consecutive differences all distinct mod n (even n)
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    if n % 2 == 0:
        return [(b + repeat) % n for b in base]
    row = [(b + repeat // 2) % n for b in base]
    return row[::-1] if repeat % 2 else row


def arrival_times(n: int, arrival: str, rate: float | None = None, seed: int = 0) -> list[float]:
    """Arrival second of each of n requests: all 0 (closed loop) or a Poisson process of ``rate``/s."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if arrival == "closed":
        return [0.0] * n
    if rate is None or not rate > 0:
        raise ValueError(f"poisson arrivals need a request rate > 0, got {rate!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_level(
    engine: Any,
    prompts: Sequence[torch.Tensor],
    *,
    label: str,
    concurrency: int,
    num_requests: int,
    sampling: Any,
    max_new_tokens: int,
    arrival: str = "closed",
    rate: float | None = None,
    seed: int = 0,
    progress: Any = None,
) -> LevelRun:
    """Serve ``num_requests`` requests (prompt ids cycled) through ``engine``; record everything.

    ``progress``: an optional tqdm bar, advanced by one per finished request.
    """
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and num_requests must be >= 1")
    if not prompts:
        raise ValueError("the workload holds no prompts")
    arrivals = arrival_times(num_requests, arrival, rate, seed)
    pending = deque(range(num_requests))
    active: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    rounds: list[RoundRecord] = []
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start

    while pending or active:
        while pending and len(active) < concurrency and arrivals[pending[0]] <= now():
            i = pending.popleft()
            rec = RequestRecord(f"{label}-{i}", arrivals[i], admitted=now())
            engine.add_request(prompts[i % len(prompts)], sampling, max_new_tokens, request_id=rec.request_id)
            rec.prefill_seconds = now() - rec.admitted
            active[rec.request_id] = rec
        if not active:  # idle until the next arrival
            time.sleep(max(0.0, arrivals[pending[0]] - now()))
            continue
        t0 = now()
        outputs = engine.step()
        t1 = now()
        info = engine.last_round
        rounds.append(RoundRecord(t0, t1 - t0, info.num_requests, sum(info.lengths), max(info.lengths),
                                  info.batch_size, sum(info.accepted), info.drafted, info.draft_seconds,
                                  info.target_seconds, info.context))
        for o in outputs:
            rec = active[o.request_id]
            rec.rounds += 1
            rec.new_tokens += len(o.new_tokens)
            if rec.new_tokens and rec.first_token != rec.first_token:  # nan: first token now
                rec.first_token = t1
            if o.finished:
                rec.finished = t1
                done.append(active.pop(o.request_id))
                if progress is not None:
                    progress.update(1)
        engine.pop_finished()
    makespan = max(r.finished for r in done)
    done.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    return LevelRun(label, concurrency, arrival, rate, makespan, rounds, done)
