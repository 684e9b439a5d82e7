"""Fitting calibrators: input validation, the temperature searches and the fit record.

Terms (c_j, a_j, z, the label masks) are defined in :mod:`dspark.calibration` and
:mod:`dspark.metrics`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dspark.calibration.format import FitInfo
from dspark.metrics import check_rounds, ece_rows, survival_labels, verified_mask

__all__ = ["check_logits", "fit_data", "fit_info", "fit_temperature", "sts_bias_search", "sts_search"]


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def check_logits(value: Any, name: str = "confidence_logits") -> torch.Tensor:
    """Raw logits as a floating tensor [R, γ]; numpy arrays become tensors."""
    z = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if z.ndim != 2:
        raise ValueError(f"{name} must be 2-D [R, γ], got shape {tuple(z.shape)}")
    if z.dtype == torch.bool or z.dtype.is_complex:
        raise TypeError(f"{name} must be a real floating tensor, got {z.dtype}")
    if not z.dtype.is_floating_point:
        z = z.to(torch.float32)
    if not torch.isfinite(z).all():
        bad = int((~torch.isfinite(z)).sum())
        raise ValueError(f"{name} contains {bad} non-finite values (NaN or inf)")
    return z


def fit_data(
    confidence_logits: Any, accepted: Any, verified: Any | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validated fitting data: z [N, γ] float64 on CPU, accepted [N], verified [N] | None."""
    z = check_logits(confidence_logits).detach().to(device="cpu", dtype=torch.float64)  # [N, γ]
    n, gamma = z.shape
    if n == 0:
        raise ValueError("cannot fit a calibrator on empty data (0 rows)")
    if gamma == 0:
        raise ValueError("cannot fit a calibrator on a block of γ = 0 positions")
    acc, ver = check_rounds(accepted, gamma, verified)
    if acc.numel() != n:
        raise ValueError(
            f"accepted has {acc.numel()} rows but confidence_logits has {n} (shape {tuple(z.shape)})"
        )
    return z, acc, ver


# --------------------------------------------------------------------------------------------
# Fit record
# --------------------------------------------------------------------------------------------


def _survival_ece(
    c: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, n_bins: int
) -> list[float]:
    """Survival ECE per position of per-step probabilities c [N, γ] on masked rows."""
    a = torch.cumprod(c, dim=1)  # [N, γ]
    out = []
    for k in range(c.shape[1]):
        m = mask[:, k]
        if not m.any():
            out.append(math.nan)
            continue
        out.append(float(ece_rows(a[m, k][None, :], labels[m, k].to(a.dtype), n_bins)[0]))
    return out


def fit_info(
    z: torch.Tensor,
    acc: torch.Tensor,
    ver: torch.Tensor | None,
    temps: torch.Tensor,
    n_bins: int,
    objective: str,
    biases: torch.Tensor | None = None,
) -> FitInfo:
    """The :class:`FitInfo` of temperatures ``temps`` [γ] (and per-position ``biases`` [γ], added
    after the division) on the fitting data z [N, γ]."""
    gamma = z.shape[1]
    labels, _ = survival_labels(acc, gamma, ver)
    mask = verified_mask(acc, gamma, ver)
    return FitInfo(
        n_samples=z.shape[0],
        gamma=gamma,
        n_labelled=mask.sum(dim=0).tolist(),
        n_bins=n_bins,
        objective=objective,
        ece_before=_survival_ece(torch.sigmoid(z), labels, mask, n_bins),
        ece_after=_survival_ece(torch.sigmoid(z / temps + (0 if biases is None else biases)), labels, mask, n_bins),
    )


# --------------------------------------------------------------------------------------------
# One temperature: BCE on the conditional labels
# --------------------------------------------------------------------------------------------


def fit_temperature(zs: torch.Tensor, ys: torch.Tensor, t_min: float, t_max: float) -> float:
    """T in [t_min, t_max] minimising the BCE of σ(zs / T) against ys (both [M]).

    The loss is convex in 1/T, hence unimodal in log T: Brent's bounded scalar search in log T
    finds it (``xatol`` 1e-8 in log T, far below the data's resolution).
    """
    from scipy.optimize import minimize_scalar  # on first fit: loading a calibrator stays light

    def nll(log_t: float) -> float:
        return float(F.binary_cross_entropy_with_logits(zs / math.exp(log_t), ys))

    bounds = (math.log(t_min), math.log(t_max))
    result = minimize_scalar(nll, bounds=bounds, method="bounded", options={"xatol": 1e-8})
    return math.exp(float(result.x))


# --------------------------------------------------------------------------------------------
# Sequential temperature scaling: one position's grid search
# --------------------------------------------------------------------------------------------


def _grid_scores(
    prefix: torch.Tensor,
    zj: torch.Tensor,
    y: torch.Tensor,
    temps: torch.Tensor,
    n_bins: int,
    biases: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Survival ECE and Brier [G] of prefix·σ(z_j / T + b) for each candidate T [G] (b [G], or 0).

    ``prefix`` [M] = Π_{i<j} c_i, ``zj`` [M], ``y`` [M]. The grid is chunked to bound memory.
    """
    m = zj.numel()
    chunk = max(1, 4_000_000 // m)
    if biases is None:
        biases = torch.zeros_like(temps)
    eces, briers = [], []
    for start in range(0, temps.numel(), chunk):
        t = temps[start : start + chunk]  # [g]
        b = biases[start : start + chunk]  # [g]
        pred = prefix[None, :] * torch.sigmoid(zj[None, :] / t[:, None] + b[:, None])  # [g, M]
        eces.append(ece_rows(pred, y, n_bins))
        briers.append(((pred - y[None, :]) ** 2).mean(dim=1))
    return torch.cat(eces), torch.cat(briers)


def _pick(ece: torch.Tensor, brier: torch.Tensor, tol: float) -> int:
    """Index of the lowest ECE; candidates within ``tol`` of it are tie-broken by Brier."""
    tied = ece <= ece.min() + tol
    return int(torch.where(tied, brier, torch.full_like(brier, math.inf)).argmin())


def sts_search(
    prefix: torch.Tensor,
    zj: torch.Tensor,
    y: torch.Tensor,
    grid: torch.Tensor,
    *,
    n_bins: int,
    refine_steps: int,
    ece_tolerance: float,
) -> float:
    """Best T_j for one position: the coarse log ``grid`` [G], then finer grids around the winner.

    ``prefix`` [M] = Π_{i<j} c_i, ``zj`` [M] and the survival labels ``y`` [M] of the rows whose
    position j was verified.
    """
    cands = grid
    ece, brier = _grid_scores(prefix, zj, y, cands, n_bins)
    best = _pick(ece, brier, ece_tolerance)
    for _ in range(refine_steps):
        lo = cands[max(best - 1, 0)].log()
        hi = cands[min(best + 1, cands.numel() - 1)].log()
        fine = torch.exp(torch.linspace(float(lo), float(hi), 41, dtype=torch.float64))
        # Keep the incumbent so refinement can never make the choice worse.
        cands = torch.cat([fine, cands[best : best + 1]])
        cands, _ = torch.sort(cands)
        ece, brier = _grid_scores(prefix, zj, y, cands, n_bins)
        best = _pick(ece, brier, ece_tolerance)
    return float(cands[best])


def sts_bias_search(
    prefix: torch.Tensor,
    zj: torch.Tensor,
    y: torch.Tensor,
    log_t: tuple[float, float],
    b_range: tuple[float, float],
    *,
    n_bins: int,
    grid: tuple[int, int] = (41, 41),
    refine_steps: int = 2,
    ece_tolerance: float,
) -> tuple[float, float]:
    """Best (T_j, b_j) for one position of STS + bias: the survival ECE of prefix·σ(z_j / T + b)
    over a 2-D grid (log T × b), then finer grids around the winner (Brier breaks ECE ties).

    ``prefix`` [M] = Π_{i<j} c_i, ``zj`` [M] and the survival labels ``y`` [M] of the rows whose
    position j was verified; ``log_t`` and ``b_range`` bound the search. The point (T = 1, b = 0)
    is always a candidate, so the fit is never worse on its data than the raw head.
    """
    (lt_lo, lt_hi), (b_lo, b_hi) = log_t, b_range
    nt, nb = grid
    best_t, best_b = 1.0, 0.0
    step_t, step_b = (lt_hi - lt_lo) / max(nt - 1, 1), (b_hi - b_lo) / max(nb - 1, 1)
    lts = torch.linspace(lt_lo, lt_hi, nt, dtype=torch.float64)  # [nt]
    bs = torch.linspace(b_lo, b_hi, nb, dtype=torch.float64)  # [nb]
    for level in range(refine_steps + 1):
        if level:  # a finer grid of the same size over the winner's neighbouring cells
            lc, bc = math.log(best_t), best_b
            lts = torch.linspace(max(lc - step_t, lt_lo), min(lc + step_t, lt_hi), nt, dtype=torch.float64)
            bs = torch.linspace(max(bc - step_b, b_lo), min(bc + step_b, b_hi), nb, dtype=torch.float64)
            step_t, step_b = 2 * step_t / max(nt - 1, 1), 2 * step_b / max(nb - 1, 1)
        tt = torch.cat([lts.exp().repeat_interleave(bs.numel()), torch.tensor([best_t], dtype=torch.float64)])
        bb = torch.cat([bs.repeat(lts.numel()), torch.tensor([best_b], dtype=torch.float64)])  # incumbent last
        ece, brier = _grid_scores(prefix, zj, y, tt, n_bins, bb)
        k = _pick(ece, brier, ece_tolerance)
        best_t, best_b = float(tt[k]), float(bb[k])
    return best_t, best_b
