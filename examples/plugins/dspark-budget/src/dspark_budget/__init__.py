"""dspark-budget: a hard token-budget scheduler and an affine cost model, as a dspark plugin."""

from __future__ import annotations

from typing import ClassVar

import torch
from attrs import field, frozen, validators

import dspark
from dspark.schedulers import SchedulerBase, survival

__version__ = "0.1.0"


@frozen
class AffineCostModel:
    """Step time = base_seconds + per_token_seconds · B, packed accounting."""

    name: ClassVar[str] = "affine"
    accounting: ClassVar[str] = "packed"
    base_seconds: float = field(default=0.02, validator=validators.gt(0.0))
    per_token_seconds: float = field(default=0.001, validator=validators.ge(0.0))

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        return self.base_seconds + self.per_token_seconds * batch_size.double()  # [K]

    def sps(self, batch_size: torch.Tensor) -> torch.Tensor:
        return 1.0 / self.step_seconds(batch_size)  # [K]

    def batch_size(self, lengths: torch.Tensor) -> int:
        return int(lengths.numel() + lengths.sum())

    def admission_batch_sizes(self, num_requests: int, positions: torch.Tensor) -> torch.Tensor:
        return num_requests + torch.arange(positions.numel() + 1)  # [K+1]


@frozen
class TokenBudgetScheduler(SchedulerBase):
    """Admit (r, j) by descending survival while B = Σ(1 + ℓ) stays within ``max_tokens``.

    Stops at the first candidate that does not fit, so the decision on (r, j) never looks at
    (r, j+1): a stopping rule, hence lossless.
    """

    name: ClassVar[str] = "token-budget"
    lossless: ClassVar[bool] = True
    max_tokens: int = field(default=64, validator=[validators.instance_of(int), validators.gt(0)])

    def lengths(self, confidence, valid_lengths, cost_model=None) -> torch.Tensor:
        R, gamma = confidence.shape
        valid = valid_lengths
        a = survival(confidence, valid)  # [R, γ]
        room = max(self.max_tokens - R, 0)  # draft tokens that fit after the R anchors
        is_valid = torch.arange(gamma)[None, :] < valid[:, None]  # [R, γ]
        key = torch.where(is_valid, a, -1.0).reshape(-1)  # invalid positions sort last
        _, order = torch.sort(key, descending=True, stable=True)  # [Rγ]
        K = min(room, int(valid.sum()))
        return torch.bincount(order[:K] // gamma, minlength=R)  # [R] ℓ; dspark builds the Schedule


@dspark.hookimpl
def register_schedulers(register):
    register("token-budget", TokenBudgetScheduler)


@dspark.hookimpl
def register_cost_models(register):
    register("affine", AffineCostModel)
