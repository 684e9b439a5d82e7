"""Monotone fits of measured step times (dspark.cost_models.fit), against independent oracles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import minimize

from dspark.cost_models.fit import isotonic, monotone_grid


def _minmax_isotonic(y: np.ndarray) -> np.ndarray:
    """The closed form of the least-squares non-decreasing fit: x_i = max_{j≤i} min_{k≥i} mean(y[j..k])."""
    n = len(y)
    return np.array([max(min(y[j:k + 1].mean() for k in range(i, n)) for j in range(i + 1)) for i in range(n)])


@pytest.mark.parametrize("seed", range(20))
def test_isotonic_equals_the_min_max_formula(seed):
    y = np.random.default_rng(seed).normal(size=1 + seed % 9)
    np.testing.assert_allclose(isotonic(y), _minmax_isotonic(y), atol=1e-12)


def test_isotonic_keeps_a_monotone_curve_and_pools_a_violation():
    np.testing.assert_array_equal(isotonic(np.array([1.0, 2.0, 2.0, 5.0])), [1.0, 2.0, 2.0, 5.0])
    np.testing.assert_allclose(isotonic(np.array([53.5, 53.1, 50.8, 56.5])), [52.4667] * 3 + [56.5], atol=1e-4)


def test_isotonic_weights_pull_the_pooled_value():
    np.testing.assert_allclose(isotonic(np.array([3.0, 1.0]), np.array([3.0, 1.0])), [2.5, 2.5])


def _qp_grid(Y: np.ndarray) -> np.ndarray:
    """The same projection by a general constrained solver (SLSQP), an independent oracle."""
    C, P = Y.shape
    cons = [{"type": "ineq", "fun": (lambda x, a=a, b=b: x[b] - x[a])}
            for c, p in itertools.product(range(C), range(P))
            for a, b in ([(c * P + p, c * P + p + 1)] if p + 1 < P else []) + ([(c * P + p, (c + 1) * P + p)] if c + 1 < C else [])]
    res = minimize(lambda x: ((x - Y.ravel()) ** 2).sum(), Y.ravel(), jac=lambda x: 2 * (x - Y.ravel()),
                   constraints=cons, method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
    assert res.success, res.message
    return res.x.reshape(C, P)


@pytest.mark.parametrize("seed", range(8))
def test_monotone_grid_is_the_least_squares_projection(seed):
    rng = np.random.default_rng(100 + seed)
    C, P = 2 + seed % 2, 3 + seed % 3
    Y = np.add.outer(np.arange(C), np.arange(P)) * 0.3 + rng.normal(scale=0.5, size=(C, P))  # rising + noise
    X = monotone_grid(Y)
    assert (np.diff(X, axis=0) >= 0).all() and (np.diff(X, axis=1) >= 0).all()
    np.testing.assert_allclose(X, _qp_grid(Y), atol=1e-5)


def test_monotone_grid_of_one_row_is_isotonic_and_keeps_a_monotone_grid():
    y = np.array([[3.0, 1.0, 2.0]])
    np.testing.assert_allclose(monotone_grid(y), isotonic(y[0])[None])
    Y = np.array([[1.0, 2.0], [1.5, 4.0]])
    np.testing.assert_array_equal(monotone_grid(Y), Y)
    with pytest.raises(ValueError, match="grid"):
        monotone_grid(np.ones(3))
