"""``dspark bench``: the command line maps its arguments onto
:class:`~dspark.bench.run.BenchOptions` and calls :func:`~dspark.bench.run.run_bench`
(:mod:`dspark.cli`); the benchmark itself lives in :mod:`dspark.bench.run`, re-exported here for
code that imported it from this module."""

from __future__ import annotations

from dspark.bench.run import build_engine, default_schedulers

__all__ = ["build_engine", "default_schedulers"]
