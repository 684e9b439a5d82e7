"""Reliability diagrams for prefix-survival confidence (optional: ``pip install dspark[plot]``).

matplotlib is imported inside the functions, never at module import, and only through its
object-oriented API with the Agg canvas: no pyplot, no global backend switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.metrics import expected_calibration_error, reliability_bins

__all__ = ["reliability_diagram"]

# (pred [N, γ], labels [N, γ]) or (pred, labels, mask [N, γ]) — mask selects the scored rows.
Curve = tuple[Any, Any] | tuple[Any, Any, Any]


def _require_matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "plotting needs matplotlib: install dspark[plot] (pip install 'dspark[plot]')"
        ) from err
    return Figure, FigureCanvasAgg


def _unpack(name: str, curve: Curve) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(curve) not in (2, 3):
        raise ValueError(f"curve {name!r} must be (pred, labels) or (pred, labels, mask)")
    pred = torch.as_tensor(curve[0]).detach().cpu().to(torch.float64)  # [N, γ]
    labels = torch.as_tensor(curve[1]).detach().cpu().to(torch.float64)  # [N, γ]
    mask = (
        torch.as_tensor(curve[2]).detach().cpu().to(torch.bool)
        if len(curve) == 3
        else torch.ones_like(pred, dtype=torch.bool)
    )  # [N, γ]
    if pred.ndim != 2 or pred.shape != labels.shape or pred.shape != mask.shape:
        raise ValueError(
            f"curve {name!r}: pred, labels and mask must share one [N, γ] shape, got "
            f"{tuple(pred.shape)}, {tuple(labels.shape)}, {tuple(mask.shape)}"
        )
    return pred, labels, mask


def reliability_diagram(
    curves: Mapping[str, Curve],
    path: str | Path,
    *,
    n_bins: int = 15,
    positions: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG with one reliability panel per draft position j (1-based).

    ``curves`` maps a label (e.g. ``"raw"``, ``"sts"``) to predicted survival a [N, γ] and
    survival labels y [N, γ], optionally with a mask [N, γ] of scored rows (from
    :func:`dspark.metrics.verified_mask`). Each panel plots the mean outcome against the mean
    prediction per equal-width bin, with the legend giving that curve's ECE at j.
    ``positions`` selects panels (default: all). Returns the written path.
    """
    if not curves:
        raise ValueError("reliability_diagram needs at least one curve")
    Figure, FigureCanvasAgg = _require_matplotlib()
    data = {name: _unpack(name, curve) for name, curve in curves.items()}
    gamma = next(iter(data.values()))[0].shape[1]
    if any(p.shape[1] != gamma for p, _, _ in data.values()):
        raise ValueError("all curves must have the same number of positions γ")
    chosen = list(positions) if positions is not None else list(range(1, gamma + 1))
    bad = [j for j in chosen if not 1 <= j <= gamma]
    if bad or not chosen:
        raise ValueError(f"positions must be a non-empty subset of 1..{gamma}, got {chosen}")

    cols = min(4, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=(3.2 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, j in zip(axes.flat, chosen):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for name, (pred, labels, mask) in data.items():
            m = mask[:, j - 1]
            p, y = pred[m, j - 1], labels[m, j - 1]
            mean_p, mean_y, count = reliability_bins(p, y, n_bins)
            keep = count > 0
            ece = expected_calibration_error(p, y, n_bins)
            ax.plot(mean_p[keep], mean_y[keep], marker="o", ms=3, lw=1.2,
                    label=f"{name} (ECE {100 * ece:.1f}%)")  # fmt: skip
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position j={j}", aspect="equal")
        ax.set_xlabel("predicted survival a_j")
        ax.set_ylabel("observed [accepted ≥ j]")
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
