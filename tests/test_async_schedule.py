"""sps-greedy's asynchronous variant (lag > 0): the budget from the confidences ``lag`` rounds
earlier, the allocation from the current ones — checked against its definition and for the
stopping-rule property that makes it lossless."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import dspark
from dspark.cost_models import SPSTableCostModel

COST = SPSTableCostModel.from_points({1: 0.010, 4: 0.011, 8: 0.013, 16: 0.020, 32: 0.040}, accounting="packed")


def _top_k(c: torch.Tensor, valid: torch.Tensor, K: int) -> list[int]:
    """Oracle: ℓ from the K largest survivals (ties: request-major, then position), longhand."""
    R, g = c.shape
    cands = []
    for r in range(R):
        a = 1.0
        for j in range(int(valid[r])):
            a *= float(c[r, j])
            cands.append((-a, r * g + j, r))
    cands.sort()
    lengths = [0] * R
    for _, _, r in cands[:K]:
        lengths[r] += 1
    return lengths


def test_budget_comes_from_lag_rounds_earlier_and_allocation_from_now():
    gen = torch.Generator().manual_seed(7)
    sync = dspark.get_scheduler("sps-greedy")
    lagged = dspark.get_scheduler("sps-greedy", lag=2)
    rounds = [(torch.rand(4, 5, generator=gen), torch.tensor([5, 3, 5, 1])) for _ in range(6)]
    budgets = []
    for t, (c, v) in enumerate(rounds):
        budgets.append(int(sync.schedule(c, v, COST).lengths.sum()))
        got = lagged.schedule(c, v, COST).lengths.tolist()
        K = budgets[t] if t < 2 else min(budgets[t - 2], int(v.sum()))
        assert got == _top_k(c, v, K), t


def test_allocation_is_a_stopping_rule():
    """Whether (r, j) is verified never depends on c_{r, j+1..}: changing the later confidences of a
    request keeps every decision on its earlier positions (so rejection sampling stays exact)."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        R, g = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        c = torch.tensor(rng.random((R, g)))
        v = torch.tensor(rng.integers(0, g + 1, R))
        K = int(rng.integers(0, R * g + 1))
        base = _top_k(c, v, K)
        for r, j in itertools.product(range(R), range(g)):
            c2 = c.clone()
            c2[r, j + 1:] = torch.tensor(rng.random(g - j - 1))
            assert (_top_k(c2, v, K)[r] > j) == (base[r] > j)


def test_lag_option_is_validated_in_one_sentence():
    with pytest.raises(ValueError, match="lag"):
        dspark.get_scheduler("sps-greedy", lag=-1)
