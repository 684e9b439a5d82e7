"""Monotone fits of measured step times: the least-squares curve that never falls.

A verification step over more tokens, or over a longer KV context, reads at least as much as a
smaller one, so its true time never falls as B or the context grows. Measured medians do fall
(a median of a few repeats on a busy machine can time B = 4 faster than B = 1, or a longer context
faster than a shorter one). A scheduler that reads such a table believes that a
longer verification costs 50 % more when it costs 2 %, and verifies too little. The fits here
project the measurements onto the monotone curves (least squares, the isotonic regression):
points that agree with monotonicity are kept exactly, violating runs are pooled to their mean.

Terms: ``y`` [P] measured times in the order of growing size; ``Y`` [C, P] a grid, row c the
curve at the c-th context (ascending), column p the p-th batch size (ascending).
"""

from __future__ import annotations

import numpy as np

__all__ = ["isotonic", "monotone_grid"]


def isotonic(y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The non-decreasing x [P] minimising Σ wᵢ (xᵢ − yᵢ)² (pool adjacent violators). [P] → [P]."""
    y = np.asarray(y, dtype=np.float64)  # [P]
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)  # [P]
    means: list[float] = []  # one entry per pooled block, left to right
    mass: list[float] = []
    counts: list[int] = []
    for value, weight in zip(y.tolist(), w.tolist()):
        means.append(value)
        mass.append(weight)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:  # a violation: pool the last two blocks
            m = mass[-2] + mass[-1]
            means[-2] = (mass[-2] * means[-2] + mass[-1] * means[-1]) / m
            mass[-2] = m
            counts[-2] += counts[-1]
            del means[-1], mass[-1], counts[-1]
    return np.repeat(np.asarray(means, dtype=np.float64), counts)  # [P]


def monotone_grid(Y: np.ndarray, tol: float = 1e-12, max_iter: int = 10_000) -> np.ndarray:
    """The X [C, P] non-decreasing along both axes minimising Σ (X − Y)² (Dykstra's alternating
    projections onto the row-monotone and the column-monotone sets, each an :func:`isotonic` per
    line). One row: :func:`isotonic` of it. [C, P] → [C, P]."""
    Y = np.asarray(Y, dtype=np.float64)  # [C, P]
    if Y.ndim != 2:
        raise ValueError(f"monotone_grid takes a [contexts, batch sizes] grid, got shape {Y.shape}")
    if Y.shape[0] == 1:
        return isotonic(Y[0])[None, :]
    X = Y.copy()  # [C, P] the current estimate
    p = np.zeros_like(Y)  # [C, P] Dykstra's correction for the row projection
    q = np.zeros_like(Y)  # [C, P] and for the column projection
    for _ in range(max_iter):
        rows = np.stack([isotonic(r) for r in X + p])  # [C, P] monotone in B
        p = X + p - rows
        cols = np.stack([isotonic(c) for c in (rows + q).T]).T  # [C, P] monotone in context
        q = rows + q - cols
        done = float(np.max(np.abs(cols - X))) <= tol * max(1.0, float(np.max(np.abs(Y))))
        X = cols
        if done:
            break
    # Converged to within tol; make both orders exact (moves no value by more than tol).
    return np.maximum.accumulate(np.maximum.accumulate(X, axis=1), axis=0)
