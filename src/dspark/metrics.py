"""Confidence metrics for speculative decoding: pure functions over tensors.

Terms, defined once (docs/concepts.md §2 and §8):

* γ — draft block size; positions are j = 1..γ (column ``j - 1`` of a ``[N, γ]`` tensor).
* ``accepted`` [N] — draft tokens accepted in a round, 0..γ (always a contiguous prefix).
* ``verified`` [N] — positions the target verified in that round (ℓ_r, the scheduler's choice),
  ``accepted ≤ verified ≤ γ``. ``None`` means every round verified all γ positions.
* c_j — per-step acceptance probability P(position j accepted | positions < j accepted).
* a_j = Π_{i≤j} c_i — prefix survival probability P(accepted ≥ j).
* survival label y_j = [accepted ≥ j]: the target of a_j.
* conditional label at j = [accepted ≥ j] among rows *at risk* (accepted ≥ j − 1, j verified):
  the target of c_j, the paper's position-wise conditional acceptance.
* Metric naming trap (docs/concepts.md §8): the reference's ``accept_rate@k`` is *prefix survival*
  (#rounds with accepted > k / #rounds with proposal > k) — here ``prefix_survival`` at
  position j = k + 1. The paper's *conditional acceptance* is a different number; both are
  reported, named apart.

Censoring. A row with ``verified = ℓ`` tells y_j for j ≤ ℓ, and y_j = 0 for every j when the prefix
broke before ℓ; only rows that survived all ℓ verified positions leave y_{j>ℓ} unknown. Those
known zeros must still *not* be used to score position j > ℓ: keeping the failures of the
short-verified rows while dropping their unknown survivors biases the observed survival low.
Survival metrics therefore use rows whose position j was verified (``verified_mask``), which is
unbiased whenever the choice of ℓ depended only on the drafter's outputs (a stopping rule).

Scalar metrics return Python floats and ``nan`` for empty input (or, for AUROC, a single class),
so that per-position reports can show a gap instead of failing. Inputs may be torch tensors or
numpy arrays; computation is in float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "auroc",
    "brier_score",
    "conditional_labels",
    "ece_noise_floor",
    "expected_calibration_error",
    "reliability_bins",
    "survival_labels",
    "verified_mask",
]

TensorLike = Any  # torch.Tensor | np.ndarray | sequence of numbers


# --------------------------------------------------------------------------------------------
# Input helpers
# --------------------------------------------------------------------------------------------


def as_tensor(value: TensorLike, name: str) -> torch.Tensor:
    """``value`` (a tensor, an array or a sequence of numbers) as a detached tensor; ``name`` is
    what a TypeError calls it."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a tensor or array, got {type(value).__name__}") from err


def _as_float_1d(value: TensorLike, name: str) -> torch.Tensor:
    t = as_tensor(value, name)
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(t.shape)}")
    t = t.to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    return t


def _pred_label(
    pred: TensorLike, label: TensorLike, *, binary: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    p = _as_float_1d(pred, "pred")  # [N]
    y = _as_float_1d(label, "label")  # [N]
    if p.shape != y.shape:
        raise ValueError(f"pred has {p.numel()} entries but label has {y.numel()}")
    if p.numel() and (p.min() < 0 or p.max() > 1):
        raise ValueError(f"pred must lie in [0, 1], got range [{p.min():.4g}, {p.max():.4g}]")
    if binary and not ((y == 0) | (y == 1)).all():
        raise ValueError("label must be binary (0/1 or bool)")
    if not binary and y.numel() and (y.min() < 0 or y.max() > 1):
        raise ValueError(f"label must lie in [0, 1], got range [{y.min():.4g}, {y.max():.4g}]")
    return p, y


def _as_counts(value: TensorLike, name: str) -> torch.Tensor:
    """Integer counts [N] as int64; integral floats are accepted (arrays loaded from JSON)."""
    t = as_tensor(value, name)
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(t.shape)}")
    if t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer counts, got a bool tensor")
    if t.dtype.is_floating_point:
        if not torch.isfinite(t).all() or not (t == t.round()).all():
            raise ValueError(f"{name} must hold whole numbers, got non-integral values")
    return t.to(device="cpu", dtype=torch.int64)


def check_rounds(
    accepted: TensorLike, gamma: int, verified: TensorLike | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate ``accepted`` [N] in 0..γ and ``verified`` [N] with accepted ≤ verified ≤ γ."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
    acc = _as_counts(accepted, "accepted")  # [N]
    if acc.numel() and (acc.min() < 0 or acc.max() > gamma):
        raise ValueError(
            f"accepted must lie in [0, γ={gamma}], got range [{int(acc.min())}, {int(acc.max())}]"
        )
    if verified is None:
        return acc, None
    ver = _as_counts(verified, "verified")  # [N]
    if ver.shape != acc.shape:
        raise ValueError(f"verified has {ver.numel()} rows but accepted has {acc.numel()}")
    if ver.numel() and (ver.min() < 0 or ver.max() > gamma):
        raise ValueError(
            f"verified must lie in [0, γ={gamma}], got range [{int(ver.min())}, {int(ver.max())}]"
        )
    bad = (acc > ver).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(
            f"accepted must be <= verified (a round cannot accept an unverified token); "
            f"row {r} has accepted={int(acc[r])} > verified={int(ver[r])}"
        )
    return acc, ver


# --------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------


def _positions(gamma: int) -> torch.Tensor:
    return torch.arange(1, gamma + 1, dtype=torch.int64)  # [γ], positions j = 1..γ


def survival_labels(
    accepted: TensorLike, gamma: int, verified: TensorLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Survival labels y_j = [accepted ≥ j] and which of them are known, both bool [N, γ].

    ``known`` is False only where the row survived every verified position
    (accepted == verified < j). Do not fit or score with ``known``: it keeps the early failures
    of short-verified rows but drops their survivors, biasing survival low. Use
    :func:`verified_mask` (position j verified) instead — see the module docstring.
    """
    acc, ver = check_rounds(accepted, gamma, verified)
    j = _positions(gamma)
    labels = acc[:, None] >= j[None, :]  # [N, γ]
    if ver is None:
        return labels, torch.ones_like(labels)
    known = (j[None, :] <= ver[:, None]) | (acc < ver)[:, None]  # [N, γ]
    return labels, known


def verified_mask(
    accepted: TensorLike, gamma: int, verified: TensorLike | None = None
) -> torch.Tensor:
    """Bool [N, γ]: position j was verified in the row's round (j ≤ verified; all if ``None``).

    The unbiased scoring mask for survival labels under a stopping-rule scheduler.
    """
    acc, ver = check_rounds(accepted, gamma, verified)
    if ver is None:
        return torch.ones(acc.numel(), gamma, dtype=torch.bool)
    return _positions(gamma)[None, :] <= ver[:, None]  # [N, γ]


def conditional_labels(
    accepted: TensorLike, gamma: int, verified: TensorLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step labels [accepted ≥ j] and the at-risk mask (accepted ≥ j − 1, j verified), [N, γ].

    The mean label over the at-risk rows is the paper's conditional acceptance
    P(position j accepted | positions < j accepted), the target of the per-step c_j.
    """
    acc, ver = check_rounds(accepted, gamma, verified)
    j = _positions(gamma)
    labels = acc[:, None] >= j[None, :]  # [N, γ]
    at_risk = acc[:, None] >= (j - 1)[None, :]  # [N, γ]
    if ver is not None:
        at_risk &= j[None, :] <= ver[:, None]
    return labels, at_risk


# --------------------------------------------------------------------------------------------
# Scalar metrics
# --------------------------------------------------------------------------------------------


def _bin_index(pred: torch.Tensor, n_bins: int) -> torch.Tensor:
    # Equal-width bins [k/n, (k+1)/n); a prediction of exactly 1 joins the last bin.
    return (pred * n_bins).floor().long().clamp_(0, n_bins - 1)


def check_bins(n_bins: int) -> None:
    """Raise ValueError unless ``n_bins`` (the equal-width bins of an ECE) is an integer >= 1."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")


def ece_rows(pred: torch.Tensor, label: torch.Tensor, n_bins: int) -> torch.Tensor:
    """ECE of each row of ``pred`` [G, N] against one ``label`` [N] → [G] (no validation).

    ECE = Σ_b (n_b / N) |mean pred_b − mean label_b| = (1/N) Σ_b |Σ_{i∈b} (pred_i − label_i)|,
    the second form letting a whole grid of candidate predictions share one scatter.
    """
    g, n = pred.shape
    sums = torch.zeros(g, n_bins, dtype=pred.dtype, device=pred.device)  # [G, bins]
    sums.scatter_add_(1, _bin_index(pred, n_bins), pred - label[None, :])
    return sums.abs().sum(dim=1) / n  # [G]


def expected_calibration_error(pred: TensorLike, label: TensorLike, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1].

    ``pred`` [N] are probabilities, ``label`` [N] outcomes in [0, 1] (binary or soft). Each bin
    contributes its share of rows times |mean prediction − mean outcome|. ``nan`` if N = 0.
    """
    check_bins(n_bins)
    p, y = _pred_label(pred, label, binary=False)
    if p.numel() == 0:
        return math.nan
    return float(ece_rows(p[None, :], y, n_bins)[0])


def ece_noise_floor(pred: TensorLike, n_bins: int = 15, draws: int = 32, seed: int = 0) -> float:
    """The ECE a *perfectly calibrated* predictor measures on this many rows: the mean ECE of
    ``pred`` [N] against labels drawn as Bernoulli(pred), over ``draws`` seeded draws.

    Binned ECE is biased upwards by the labels' sampling noise (≈ Σ_b (n_b/N)·√(p_b(1−p_b)/n_b)),
    so a measured ECE near this floor is as calibrated as N rows can show; ``nan`` if N = 0.
    """
    check_bins(n_bins)
    p = as_tensor(pred, "pred").to(torch.float64).reshape(-1)
    if p.numel() == 0:
        return math.nan
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(draws, p.numel(), generator=g, dtype=torch.float64) < p[None, :]).to(torch.float64)  # [D, N]
    sums = torch.zeros(draws, n_bins, dtype=torch.float64)  # [D, bins]
    sums.scatter_add_(1, _bin_index(p, n_bins)[None, :].expand(draws, -1), p[None, :] - y)
    return float((sums.abs().sum(dim=1) / p.numel()).mean())


def brier_score(pred: TensorLike, label: TensorLike) -> float:
    """Mean squared error (pred − label)² of probabilities [N] against outcomes [N]; ``nan`` if N = 0."""
    p, y = _pred_label(pred, label, binary=False)
    if p.numel() == 0:
        return math.nan
    return float(((p - y) ** 2).mean())


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of ``x`` [N], tied values sharing their average rank."""
    uniq, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    below = torch.cumsum(counts, 0) - counts  # [U] values strictly smaller
    avg = below.to(torch.float64) + (counts.to(torch.float64) + 1) / 2  # [U]
    return avg[inverse]  # [N]


def auroc(pred: TensorLike, label: TensorLike) -> float:
    """Area under the ROC curve: P(score of a random positive > a random negative), ties = ½.

    Computed from ranks (Mann–Whitney U with average ranks for ties), O(N log N).
    ``nan`` when ``label`` holds only one class (the AUROC is undefined).
    """
    p = _as_float_1d(pred, "pred")  # any real scores are fine for a ranking metric
    y = _as_float_1d(label, "label")
    if p.shape != y.shape:
        raise ValueError(f"pred has {p.numel()} entries but label has {y.numel()}")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("label must be binary (0/1 or bool)")
    pos = y == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = float(_average_ranks(p)[pos].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def reliability_bins(
    pred: TensorLike, label: TensorLike, n_bins: int = 15
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width bin: mean prediction, mean outcome and row count (numpy [n_bins] each).

    Empty bins hold ``nan`` means and a zero count. The points of a reliability diagram.
    """
    check_bins(n_bins)
    p, y = _pred_label(pred, label, binary=False)
    idx = _bin_index(p, n_bins)  # [N]
    count = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p))
    sum_p = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, p)
    sum_y = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, y)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = count.numpy()
        return sum_p.numpy() / c, sum_y.numpy() / c, c.astype(np.int64)
