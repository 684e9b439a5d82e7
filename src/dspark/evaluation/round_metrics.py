"""The paper's metrics over recorded :class:`~dspark.evaluation.rounds.Rounds`: τ, proposal length,
verify rate, confidence quality, the threshold sweep, and STS fitted on rounds.

Terms (docs/concepts.md §2 and §8, :mod:`dspark.metrics`): a *round* drafts γ tokens, the target verifies
ℓ of them and accepts a prefix of ``accepted`` (+1 committed bonus/correction token).

* τ — mean committed tokens per round, mean(accepted + 1).
* proposal length — mean valid draft length; verify rate — Σ verified / Σ proposed.
* conditional acceptance at j — P(position j accepted | positions < j accepted) (paper Fig. 2);
  prefix survival at j — P(accepted ≥ j) (the reference's ``accept_rate@(j−1)``). Named apart.
* threshold sweep — for a survival threshold θ, a round verifies ℓ(θ) = #{j : a_j ≥ θ} positions
  (a_j = Π_{i≤j} c_i, calibrated); accepted = min(accepted, ℓ) and the rest of ℓ was verified in
  vain. Computed offline from rounds that verified every position (``full`` scheduler), which is
  exact for the acceptance counts because truncation is a stopping rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dspark.evaluation.rounds import Rounds

__all__ = ["ECE_BINS", "evaluate_rounds", "fit_sts_from_rounds", "threshold_sweep"]


def threshold_sweep(a: torch.Tensor, accepted: torch.Tensor, thresholds: Sequence[float],
                    proposed: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """a [N, γ] calibrated survival, accepted [N] (full verification), proposed [N] valid draft
    lengths → per θ: verified, accepted and rejected-verified token totals, mean verified ℓ̄, τ."""
    out = []
    for th in thresholds:
        ell = (a >= th).long().cumprod(1).sum(1)  # [N] leading positions with a_j ≥ θ
        if proposed is not None:
            ell = torch.minimum(ell, proposed)
        acc = torch.minimum(accepted, ell)
        out.append({"threshold": float(th), "verified": int(ell.sum()), "accepted": int(acc.sum()),
                    "rejected_verified": int((ell - acc).sum()), "mean_verified": float(ell.float().mean()),
                    "tau": float((acc + 1).float().mean())})
    return out


ECE_BINS = 20
"""Equal-width bins of the reported ECE (the paper's)."""


def fit_sts_from_rounds(rounds: Rounds, objective: str = "ece", *, bias: bool = False,
                        n_bins: int = ECE_BINS) -> Any:
    """STS (``bias=True``: STS + per-position bias) on ``rounds``: T_j (and b_j) by survival ECE
    with ``n_bins`` bins (the paper's objective, Brier breaks ECE ties) or by Brier score alone
    (``objective="brier"``: a proper scoring rule, less prone to fitting the bin noise of a small
    calibration set)."""
    import dspark

    if objective not in ("ece", "brier"):
        raise ValueError(f"objective must be 'ece' or 'brier', got {objective!r}")
    kw = {"n_bins": n_bins, **({"ece_tolerance": 1.0} if objective == "brier" else {})}
    cal = dspark.get_calibrator("sts-bias" if bias else "sts", **kw)
    return cal.fit(rounds.confidence_logits, rounds.accepted, rounds.verified)


def _summary(r: Rounds) -> dict[str, Any]:
    n = len(r.domain)
    return {"rounds": n, "tau": float((r.accepted + 1).float().mean()) if n else math.nan,
            "mean_proposed": float(r.proposed.float().mean()) if n else math.nan,
            "verify_rate": float(r.verified.sum() / r.proposed.sum().clamp_min(1)) if n else math.nan}


def evaluate_rounds(rounds: Rounds, calibrator: Any = None, thresholds: Sequence[float] = (),
                    n_bins: int = ECE_BINS) -> dict[str, Any]:
    """Per domain and overall: τ, proposal length, verify rate, the confidence report (raw and,
    with ``calibrator``, calibrated; ECE over ``n_bins`` equal-width bins), and the threshold sweep
    on calibrated survival."""
    from dspark.confidence_report import confidence_report

    domains = sorted(set(rounds.domain))
    out: dict[str, Any] = {"domains": {}, "overall": {}}
    for name in [*domains, None]:
        r = rounds if name is None else rounds.take(torch.tensor([d == name for d in rounds.domain]))
        res = _summary(r)
        raw_c = torch.sigmoid(r.confidence_logits.float())
        res["raw"] = confidence_report(raw_c, r.accepted, r.verified, n_bins).to_dict()
        cal_c = raw_c
        if calibrator is not None:
            cal_c = calibrator.calibrate(r.confidence_logits.float()).float()
            res["calibrated"] = confidence_report(cal_c, r.accepted, r.verified, n_bins).to_dict()
        if thresholds:
            res["threshold_sweep"] = threshold_sweep(torch.cumprod(cal_c, 1), r.accepted, thresholds, r.proposed)
        if name is None:
            out["overall"] = res
        else:
            out["domains"][name] = res
    return out
