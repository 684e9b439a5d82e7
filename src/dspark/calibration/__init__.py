"""Calibration: raw confidence logits z [R, γ] → calibrated per-step probabilities c [R, γ].

c_j = σ(z_j / T_j) is the probability that draft position j is accepted given that positions < j
were; a_j = Π_{i≤j} c_i is the prefix survival the scheduler ranks by (docs/concepts.md §2). A small
per-step bias compounds in a_j, so calibration is judged on survival. Terms and label masks are
defined in :mod:`dspark.metrics`.

* :class:`IdentityCalibrator` — c = σ(z), the raw confidence head.
* :class:`TemperatureCalibrator` — one T for every position, minimising the BCE of σ(z_j / T)
  against the per-step conditional labels.
* :class:`STSCalibrator` — sequential temperature scaling: for j = 1..γ in order, T_j minimises the
  survival ECE of Π_{i≤j} σ(z_i / T_i) against [accepted ≥ j], earlier T fixed.
* :class:`STSBiasCalibrator` — STS with a per-position bias, c_j = σ(z_j / T_j + b_j), (T_j, b_j)
  fitted in the same sequential way.

Calibrators are frozen: ``fit`` returns a new fitted instance and leaves ``self`` untouched.

JSON format (``to_dict`` / ``save`` / :func:`load_calibrator`)::

    {"format": "dspark.calibrator", "format_version": 1,
     "name": "sts",                 # dispatch key: identity | temperature | sts | sts-bias
     "gamma": 7,                    # positions fitted (null: unfitted / any length)
     "temperatures": [T_1, ...],    # identity: [], temperature: [T] (shared), sts(-bias): [T_1..T_γ]
     "biases": [b_1, ...],          # sts-bias only: one b_j per position
     "options": {...},              # fitting hyper-parameters: the fields but T and fit_info
     "fit": null | {"n_samples": N, "gamma": γ, "n_labelled": [...], "n_bins": 15,
                    "objective": "...", "ece_before": [...], "ece_after": [...]}}

``ece_before`` / ``ece_after`` are per-position survival ECEs on the fitting data under the raw
σ(z) and under the fitted calibrator (``null`` where a position had no verified rows).

Modules: :mod:`~dspark.calibration.temperature` (identity and the single temperature),
:mod:`~dspark.calibration.sts` (STS and STS + bias), :mod:`~dspark.calibration.fitting` (input
checks, the temperature searches, the fit record's ECEs), :mod:`~dspark.calibration.format` (the JSON format's helpers and :class:`FitInfo`),
:mod:`~dspark.calibration.loading` (:func:`load_calibrator`, :data:`BUILTIN_CALIBRATORS`) and
:mod:`~dspark.calibration.synthetic` (rounds with known miscalibration). Everything public is
importable from ``dspark.calibration``.
"""

from __future__ import annotations

from dspark.calibration.format import FORMAT as FORMAT  # the format's constants, outside __all__
from dspark.calibration.format import FORMAT_VERSION as FORMAT_VERSION
from dspark.calibration.format import CalibratorFormatError, FitInfo
from dspark.calibration.loading import BUILTIN_CALIBRATORS, load_calibrator
from dspark.calibration.sts import STSBiasCalibrator, STSCalibrator
from dspark.calibration.synthetic import SyntheticRounds, synthetic_rounds
from dspark.calibration.temperature import IdentityCalibrator, TemperatureCalibrator

__all__ = [
    "BUILTIN_CALIBRATORS",
    "CalibratorFormatError",
    "FitInfo",
    "IdentityCalibrator",
    "STSBiasCalibrator",
    "STSCalibrator",
    "SyntheticRounds",
    "TemperatureCalibrator",
    "load_calibrator",
    "synthetic_rounds",
]
