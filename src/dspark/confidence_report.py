"""The per-position confidence report: how well calibrated per-step probabilities c [N, γ] predict
the acceptance observed in recorded rounds (survival and conditional columns, named apart).

Terms (γ, accepted, verified, c_j, a_j, the survival and conditional labels, censoring and the
naming trap between prefix survival and conditional acceptance) are defined in
:mod:`dspark.metrics`, whose label masks and scalar metrics this report applies per position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from attrs import field, frozen

from dspark import serialization
from dspark.metrics import (
    TensorLike,
    as_tensor,
    auroc,
    brier_score,
    check_bins,
    check_rounds,
    conditional_labels,
    expected_calibration_error,
    survival_labels,
    verified_mask,
)

__all__ = ["ConfidenceReport", "confidence_report"]


def _floats(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@frozen
class ConfidenceReport:
    """Per-position confidence quality; every field is a tuple with one entry per position j.

    Survival columns score a_j = Π_{i≤j} c_i against y_j = [accepted ≥ j] on rows whose position
    j was verified (``count`` of them): ``ece``, ``auroc``, ``brier``, ``mean_predicted`` (mean
    a_j), ``observed`` (mean y_j) and ``cumprod_bias`` = mean_predicted − observed.
    ``prefix_survival`` is the same observed survival under the reference's name
    ``accept_rate@(j−1)`` (#rounds accepted ≥ j / #rounds verified ≥ j), kept so that it is never
    confused with ``conditional_acceptance``: the observed P(j accepted | < j accepted) over the
    ``count_conditional`` at-risk rows, to be compared with ``mean_predicted_conditional``
    (mean c_j on those rows).
    """

    n_bins: int
    count: tuple[int, ...] = field(converter=_ints)
    ece: tuple[float, ...] = field(converter=_floats)
    auroc: tuple[float, ...] = field(converter=_floats)
    brier: tuple[float, ...] = field(converter=_floats)
    mean_predicted: tuple[float, ...] = field(converter=_floats)
    observed: tuple[float, ...] = field(converter=_floats)
    cumprod_bias: tuple[float, ...] = field(converter=_floats)
    prefix_survival: tuple[float, ...] = field(converter=_floats)
    count_conditional: tuple[int, ...] = field(converter=_ints)
    conditional_acceptance: tuple[float, ...] = field(converter=_floats)
    mean_predicted_conditional: tuple[float, ...] = field(converter=_floats)

    def __attrs_post_init__(self) -> None:
        lengths = {len(getattr(self, a.name)) for a in self.__attrs_attrs__ if a.name != "n_bins"}
        if len(lengths) != 1:
            raise ValueError(
                f"ConfidenceReport columns must share one length, got {sorted(lengths)}"
            )

    @property
    def gamma(self) -> int:
        return len(self.count)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``gamma``, ``n_bins`` and one list per column (``nan`` → ``None``)."""
        return {"gamma": self.gamma, **serialization.to_dict(self, nan_as_none=True)}

    def to_markdown(self, title: str | None = None) -> str:
        """A markdown table, one row per position j."""
        head = [
            "j", "n", "ECE", "AUROC", "Brier", "mean pred a_j", "observed survival",
            "cumprod bias", "cond. accept (obs)", "mean pred c_j",
        ]  # fmt: skip
        lines = [f"**{title}**", ""] if title else []
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in range(self.gamma):
            cells = [
                str(k + 1),
                str(self.count[k]),
                _pct(self.ece[k]),
                _num(self.auroc[k]),
                _num(self.brier[k]),
                _num(self.mean_predicted[k]),
                _num(self.observed[k]),
                _signed(self.cumprod_bias[k]),
                _num(self.conditional_acceptance[k]),
                _num(self.mean_predicted_conditional[k]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{100 * v:.2f} %"


def _num(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.4f}"


def _signed(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:+.4f}"


def _mean(x: torch.Tensor) -> float:
    return float(x.to(torch.float64).mean()) if x.numel() else math.nan


def confidence_report(
    c: TensorLike,
    accepted: TensorLike,
    verified: TensorLike | None = None,
    n_bins: int = 15,
) -> ConfidenceReport:
    """Score calibrated per-step probabilities ``c`` [N, γ] against observed ``accepted`` [N].

    ``verified`` [N] (optional) marks censored rounds; see the module docstring for the masks.
    """
    check_bins(n_bins)
    probs = as_tensor(c, "c")
    if probs.ndim != 2:
        raise ValueError(f"c must be 2-D [N, γ], got shape {tuple(probs.shape)}")
    probs = probs.to(device="cpu", dtype=torch.float64)
    n, gamma = probs.shape
    if not torch.isfinite(probs).all() or (n and (probs.min() < 0 or probs.max() > 1)):
        raise ValueError("c must hold probabilities in [0, 1] (apply a calibrator to raw logits)")
    acc, ver = check_rounds(accepted, gamma, verified)
    if acc.numel() != n:
        raise ValueError(f"accepted has {acc.numel()} rows but c has {n}")
    survival = torch.cumprod(probs, dim=1)  # [N, γ] a_j
    y, _ = survival_labels(acc, gamma, ver)  # [N, γ]
    seen = verified_mask(acc, gamma, ver)  # [N, γ]
    y_cond, at_risk = conditional_labels(acc, gamma, ver)  # [N, γ]

    cols: dict[str, list[float]] = {k: [] for k in ("ece", "auroc", "brier", "mean_predicted", "observed", "conditional_acceptance", "mean_predicted_conditional")}  # fmt: skip
    count, count_cond = [], []
    for k in range(gamma):
        m = seen[:, k]
        a_k, y_k = survival[m, k], y[m, k].to(torch.float64)
        count.append(int(m.sum()))
        cols["ece"].append(expected_calibration_error(a_k, y_k, n_bins))
        cols["auroc"].append(auroc(a_k, y_k))
        cols["brier"].append(brier_score(a_k, y_k))
        cols["mean_predicted"].append(_mean(a_k))
        cols["observed"].append(_mean(y_k))
        r = at_risk[:, k]
        count_cond.append(int(r.sum()))
        cols["conditional_acceptance"].append(_mean(y_cond[r, k]))
        cols["mean_predicted_conditional"].append(_mean(probs[r, k]))
    bias = [p - o for p, o in zip(cols["mean_predicted"], cols["observed"])]
    return ConfidenceReport(
        n_bins=n_bins,
        count=count,
        cumprod_bias=bias,
        prefix_survival=cols["observed"],
        count_conditional=count_cond,
        **cols,
    )
