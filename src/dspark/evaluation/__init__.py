"""Evaluating drafters against their target: rounds, the paper's metrics, calibration.

* :mod:`dspark.evaluation.rounds` — per-round records of a drafter on a prompt set
  (:class:`~dspark.evaluation.rounds.Rounds`) and :func:`~dspark.evaluation.rounds.collect_rounds`;
* :mod:`dspark.evaluation.round_metrics` — τ, proposal length, verify rate, confidence quality and
  the threshold sweep over those rounds, and STS fitted on them;
* :mod:`dspark.evaluation.inputs` and :mod:`dspark.evaluation.drafter_specs` — the held-out prompts,
  the target, and the drafters as the commands name them;
* :mod:`dspark.evaluation.calibration_run` and :mod:`dspark.evaluation.eval_run` — the library
  functions behind ``dspark calibrate`` (:func:`~dspark.evaluation.calibration_run.calibrate`) and
  ``dspark eval`` (:func:`~dspark.evaluation.eval_run.evaluate`), whose reports
  :mod:`dspark.evaluation.reports` renders.

The package imports nothing itself: ``import dspark.evaluation.eval_run`` stays cheap until a
function runs.
"""
