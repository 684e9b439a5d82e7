"""Serving benchmarks: throughput vs concurrency per scheduler, measured and simulated.

``dspark bench`` (:mod:`dspark.bench.run`) runs a workload through :class:`dspark.Engine` at each
concurrency level (:mod:`dspark.bench.runner`), or replays recorded acceptance traces against a
cost model (:mod:`dspark.bench.simulate`, priced by :mod:`dspark.bench.costs`); both produce
:class:`LevelRun` records summarised by the same code (:mod:`dspark.bench.records`) and reported
as JSON, Markdown and PNG (:mod:`dspark.bench.report`). The draft gate's prior for a benchmark
comes from :mod:`dspark.bench.prior`.
"""

from dspark.bench.records import LevelRun, RequestRecord, RoundRecord, summarise_run
from dspark.bench.runner import (
    SchedulerSpec,
    arrival_times,
    parse_scheduler_spec,
    parse_scheduler_specs,
    run_level,
)
from dspark.bench.simulate import (
    TimeModel,
    Trace,
    fit_time_model,
    simulate_level,
    traces_from_rounds,
)

__all__ = [
    "LevelRun", "RequestRecord", "RoundRecord", "SchedulerSpec", "TimeModel", "Trace", "arrival_times",
    "fit_time_model", "parse_scheduler_spec", "parse_scheduler_specs", "run_level", "simulate_level", "summarise_run", "traces_from_rounds",
]
