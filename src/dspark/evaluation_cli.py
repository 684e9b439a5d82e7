"""``dspark calibrate`` and ``dspark eval``: the command line maps its arguments onto
:class:`~dspark.evaluation_runs.CalibrateOptions` / :class:`~dspark.evaluation_runs.EvalOptions`
and calls :func:`~dspark.evaluation_runs.calibrate` / :func:`~dspark.evaluation_runs.evaluate`
(:mod:`dspark.cli`). The helpers other commands and scripts import from here live in
:mod:`dspark.evaluation_runs`.
"""

from __future__ import annotations

from dspark.evaluation_runs import (
    THRESHOLDS,
    eval_markdown,
    eval_prompts,
    load_drafter_spec,
    plot_acceptance,
)

__all__ = ["THRESHOLDS", "eval_markdown", "eval_prompts", "load_drafter_spec", "plot_acceptance"]
