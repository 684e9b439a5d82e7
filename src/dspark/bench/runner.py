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

__all__ = ["ARRIVALS", "REPLICA", "SchedulerSpec", "arrival_times", "build_engine", "check_lossless", "default_schedulers",
           "parse_scheduler_spec", "parse_scheduler_specs", "replica_of", "run_level", "run_level_interleaved", "run_order"]

ARRIVALS = ("closed", "poisson")
REPLICA = "#"  # an entry listed again runs again as a replica: "plain", "plain#2", ...


@frozen
class SchedulerSpec:
    """A benchmark entry: ``plain`` (no drafter) or a registered scheduler with its config."""

    label: str
    name: str  # "plain" or a scheduler name in the registry
    config: dict[str, Any]

    @property
    def plain(self) -> bool:
        return self.name == "plain"

    @property
    def replica(self) -> bool:
        """A second (third, ...) run of an entry listed before it: an A/A control."""
        return replica_of(self.label) is not None


def replica_of(label: str) -> str | None:
    """The entry a replica label repeats (``plain#2`` → ``plain``), or None for an original."""
    base, sep, k = label.rpartition(REPLICA)
    return base if sep and k.isdigit() else None


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
    if REPLICA in spec:
        raise ValueError(f"scheduler spec {spec!r}: {REPLICA!r} is reserved for replica labels; list an entry "
                         "twice to run it twice")
    return SchedulerSpec(spec.strip(), name, config)


def parse_scheduler_specs(specs: Sequence[str]) -> list[SchedulerSpec]:
    """Several specs; an entry listed again becomes a replica labelled ``LABEL#2``, ``LABEL#3``, ...
    — the same scheduler run again beside the original (an A/A control: the spread between the
    two is the noise floor a ratio between different schedulers must clear)."""
    out: list[SchedulerSpec] = []
    seen: dict[str, int] = {}
    for text in specs:
        s = parse_scheduler_spec(text)
        seen[s.label] = seen.get(s.label, 0) + 1
        out.append(s if seen[s.label] == 1 else SchedulerSpec(f"{s.label}{REPLICA}{seen[s.label]}", s.name, s.config))
    return out


def build_lossless(spec: SchedulerSpec, why: str) -> Any:
    """The scheduler of a non-plain ``spec``; a lossy one is refused with ``why`` losslessness is needed."""
    import dspark

    scheduler = dspark.get_scheduler(spec.name, **spec.config)
    if not getattr(scheduler, "lossless", False):
        raise ValueError(f"scheduler {spec.label!r} is not lossless; {why}")
    return scheduler


def default_schedulers(gamma: int) -> list[str]:
    """The entries ``dspark bench`` compares when none are given, for drafters of γ = ``gamma``."""
    return ["plain", "fixed:k=1", f"fixed:k={gamma}", "threshold", "sps-greedy"]


def build_engine(target: Any, drafter: Any, spec: Any, cost_model: Any, calibrator: Any, gate: bool,
                 seed: int = 0, prior: Any = None) -> Any:
    """An engine for one benchmark entry; ``plain`` has no drafter (and captures no features);
    gated entries' draft gate starts from ``prior`` (a :class:`dspark.gate_forecast.GatePrior` or None)."""
    import dspark
    from dspark.engine import Engine
    from dspark.gating import DraftGate

    if spec.plain:
        return Engine(target, None, cost_model=cost_model, seed=seed)
    scheduler = dspark.get_scheduler(spec.name, **spec.config)
    return Engine(target, drafter, scheduler=scheduler, cost_model=cost_model, calibrator=calibrator or "identity",
                  draft_gate=DraftGate(prior=prior) if gate else None, seed=seed)


def check_lossless(specs: list[SchedulerSpec]) -> None:
    """A ValueError before any model loads for a scheduler the benchmark must not serve (lossy)."""
    for s in specs:
        if not s.plain:
            build_lossless(s, "the benchmark serves real requests")


def run_order(n: int, repeat: int) -> list[int]:
    """The order in which repeat ``repeat`` runs n schedulers: a row of a Williams design. For even
    n, over n repeats each scheduler runs once at every position (fair under slow drift, as a
    rotation is) and directly after every other scheduler exactly once; for odd n the same holds
    over 2n repeats (each row followed by its mirror image). A rotation keeps each scheduler's
    predecessor fixed, so whatever a run leaves behind (a heavy drafting run's heap, a warm cache)
    would bias the same ratio in every repeat (one scheduler always running right after the one
    with the largest verification batches, say)."""
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


class _Serving:
    """One engine serving one level's requests, a step at a time, on a clock of its own.

    ``virtual`` False: the wall clock (idle gaps before a Poisson arrival are slept). True: a
    virtual clock that advances only by the seconds of this engine's own admissions and rounds
    (idle gaps are skipped), so engines stepped in turn each see their own time only."""

    def __init__(self, engine: Any, prompts: Sequence[torch.Tensor], label: str, concurrency: int,
                 num_requests: int, sampling: Any, max_new_tokens: int, arrivals: list[float],
                 progress: Any, virtual: bool) -> None:
        if concurrency < 1 or num_requests < 1:
            raise ValueError("concurrency and num_requests must be >= 1")
        if not prompts:
            raise ValueError("the workload holds no prompts")
        self.engine, self.prompts, self.label = engine, prompts, label
        self.concurrency, self.sampling, self.max_new_tokens = concurrency, sampling, max_new_tokens
        self.arrivals, self.progress, self.virtual = arrivals, progress, virtual
        self.pending = deque(range(num_requests))
        self.active: dict[str, RequestRecord] = {}
        self.done: list[RequestRecord] = []
        self.rounds: list[RoundRecord] = []
        self.elapsed = 0.0  # the virtual clock
        self.start = time.perf_counter()

    def now(self) -> float:
        return self.elapsed if self.virtual else time.perf_counter() - self.start

    def _timed(self, fn: Any) -> tuple[Any, float, float]:
        t0 = self.now()
        w0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - w0
        if self.virtual:
            self.elapsed += dt
        return out, t0, (t0 + dt if self.virtual else self.now())

    @property
    def finished(self) -> bool:
        return not (self.pending or self.active)

    def step(self) -> None:
        """Admit what has arrived, then run one round (or wait for the next arrival)."""
        while self.pending and len(self.active) < self.concurrency and self.arrivals[self.pending[0]] <= self.now():
            i = self.pending.popleft()
            rec = RequestRecord(f"{self.label}-{i}", self.arrivals[i], admitted=self.now())
            _, _, t1 = self._timed(lambda i=i, rec=rec: self.engine.add_request(
                self.prompts[i % len(self.prompts)], self.sampling, self.max_new_tokens, request_id=rec.request_id))
            rec.prefill_seconds = t1 - rec.admitted
            self.active[rec.request_id] = rec
        if not self.active:  # idle until the next arrival
            gap = max(0.0, self.arrivals[self.pending[0]] - self.now())
            if self.virtual:
                self.elapsed += gap
            else:
                time.sleep(gap)
            return
        outputs, t0, t1 = self._timed(self.engine.step)
        info = self.engine.last_round
        self.rounds.append(RoundRecord(t0, t1 - t0, info.num_requests, sum(info.lengths), max(info.lengths),
                                       info.batch_size, sum(info.accepted), info.drafted, info.draft_seconds,
                                       info.target_seconds, info.context))
        for o in outputs:
            rec = self.active[o.request_id]
            rec.rounds += 1
            rec.new_tokens += len(o.new_tokens)
            if rec.new_tokens and rec.first_token != rec.first_token:  # nan: first token now
                rec.first_token = t1
            if o.finished:
                rec.finished = t1
                self.done.append(self.active.pop(o.request_id))
                if self.progress is not None:
                    self.progress.update(1)
        self.engine.pop_finished()

    def result(self, arrival: str, rate: float | None) -> LevelRun:
        makespan = max(r.finished for r in self.done)
        self.done.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        return LevelRun(self.label, self.concurrency, arrival, rate, makespan, self.rounds, self.done)


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
    serving = _Serving(engine, prompts, label, concurrency, num_requests, sampling, max_new_tokens,
                       arrival_times(num_requests, arrival, rate, seed), progress, virtual=False)
    while not serving.finished:
        serving.step()
    return serving.result(arrival, rate)


def run_level_interleaved(
    engines: dict[str, Any],
    prompts: Sequence[torch.Tensor],
    *,
    concurrency: int,
    num_requests: int,
    sampling: Any,
    max_new_tokens: int,
    arrival: str = "closed",
    rate: float | None = None,
    seed: int = 0,
    progress: Any = None,
) -> dict[str, LevelRun]:
    """The same workload through every engine of ``engines`` (label → engine), one round of each in
    turn, each on a virtual clock of its own seconds only: a drift of the machine's speed then lands
    on all of them alike, where runs one after another each see a different minute (``dspark bench
    --interleave``). Each turn's order is a fresh permutation (seeded by ``seed``), so every engine
    follows every other equally often on average: a rotation gives each engine one neighbour as its
    predecessor twice as often as the other (three engines), and a drafting neighbour leaves the
    caches holding its drafter's weights. Returns label → LevelRun, as :func:`run_level` would for
    each engine alone."""
    if not engines:
        raise ValueError("need at least one engine")
    arrivals = arrival_times(num_requests, arrival, rate, seed)
    serving = {label: _Serving(e, prompts, label, concurrency, num_requests, sampling, max_new_tokens, arrivals,
                               progress, virtual=True) for label, e in engines.items()}
    labels, rng = list(serving), random.Random(f"interleave-{seed}")
    while not all(s.finished for s in serving.values()):
        for label in rng.sample(labels, len(labels)):
            if not serving[label].finished:
                serving[label].step()
    return {label: s.result(arrival, rate) for label, s in serving.items()}
