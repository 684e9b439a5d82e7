"""Built-in confidence models: where raw confidence logits come from.

``draft-head`` passes through the logits of the drafter's own confidence head (DSpark), falling
back to the proxy when a drafter has none. ``max-prob`` is the documented proxy for drafters without
a head (DFlash, Eagle3, n-gram): the logit of max_v softmax(Ũ_j)(v) (of q_j when a block has no
logits). It reads Ũ_j / q_j, which depend on h_j and x̂_{j-1} only, so it keeps the stopping-rule property; a proxy built from q_j(x̂_j), the probability
of the token actually drawn, would *not* (it reads x̂_j) and is deliberately not offered.
``head-max-prob`` stacks the two per position with weights fitted on held-out rounds
(:func:`fit_head_max_prob`): on dspark-5l-xl's natural eval rounds the proxy alone ranks
acceptance better than the head at positions 1–6, and the stack better than either
(docs/results.md, "Confidence features").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen

from dspark.types import DraftBlock

__all__ = ["CONFIDENCE_FILE", "DraftHeadConfidence", "HeadMaxProbConfidence", "MaxProbConfidence",
           "fit_head_max_prob", "load_confidence_model", "max_prob_logits"]

CONFIDENCE_FILE = "confidence.json"
"""A checkpoint folder's own confidence model, next to its calibration.json (fitted on its logits)."""


def max_prob_logits(q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """logit(max_v q_j(v)), clamped away from ±inf. q [R, γ, V] → [R, γ]."""
    m = q.float().amax(dim=-1).clamp(eps, 1 - eps)  # [R, γ]
    return torch.logit(m)


def _proxy_distribution(block: DraftBlock) -> torch.Tensor:
    """softmax(Ũ_j) when the block carries its logits (a greedy q is one-hot and says nothing),
    else q. Either depends on h_j and x̂_{j-1} only."""
    if block.draft_logits is not None:
        return torch.softmax(block.draft_logits.float(), dim=-1)
    return block.q


@frozen
class MaxProbConfidence:
    """Proxy confidence: the draft distribution's largest probability at each position."""

    name = "max-prob"
    eps: float = field(default=1e-6)

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        return max_prob_logits(_proxy_distribution(block), self.eps)  # [R, γ]


@frozen
class DraftHeadConfidence:
    """The drafter's own confidence head; the max-prob proxy when the block carries none."""

    name = "draft-head"

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        if block.confidence_logits is not None:
            return block.confidence_logits  # [R, γ]
        return max_prob_logits(_proxy_distribution(block))


def _to_weights(value: object) -> tuple[tuple[float, float, float], ...]:
    try:
        rows = tuple(tuple(float(v) for v in row) for row in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"weights must be rows [w_head, w_maxprob, bias], one per draft position, got {value!r}") from None
    if not rows or any(len(r) != 3 or not all(math.isfinite(v) for v in r) for r in rows):
        raise ValueError("weights must be one finite [w_head, w_maxprob, bias] row per draft position, "
                         f"got {len(rows)} row(s) {rows!r}")
    return rows


@frozen
class HeadMaxProbConfidence:
    """The head and the max-prob proxy stacked: at position j the logit is
    w_j · z_head_j + v_j · logit(max_v softmax(Ũ_j)) + b_j, with ``weights`` rows (w_j, v_j, b_j)
    fitted by :func:`fit_head_max_prob`. Both inputs read h_j and x̂_{j-1} only, so the stopping-rule
    property holds. Needs a drafter with a confidence head and γ = len(weights)."""

    name = "head-max-prob"
    weights: tuple[tuple[float, float, float], ...] = field(converter=_to_weights)
    eps: float = field(default=1e-6)

    @classmethod
    def create(cls, path: str | os.PathLike[str] | None = None,
               weights: Sequence[Sequence[float]] | None = None) -> HeadMaxProbConfidence:
        """The registered factory: from a JSON file written by :meth:`save` or from ``weights``."""
        if (path is None) == (weights is None):
            raise ValueError("head-max-prob takes path= (a confidence.json) or weights=, exactly one")
        return cls.load(path) if path is not None else cls(weights)  # type: ignore[arg-type]

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        if block.confidence_logits is None:
            raise ValueError("head-max-prob needs a drafter with a confidence head; this block carries none "
                             "(use 'max-prob')")
        z_head = block.confidence_logits.float()  # [R, γ]
        if z_head.shape[1] != len(self.weights):
            raise ValueError(f"head-max-prob was fitted for γ = {len(self.weights)} draft positions; "
                             f"the drafter proposes {z_head.shape[1]}")
        return self.stack(z_head, max_prob_logits(_proxy_distribution(block), self.eps))

    def stack(self, z_head: torch.Tensor, z_prob: torch.Tensor) -> torch.Tensor:
        """w_j · z_head + v_j · z_prob + b_j per position. [N, γ] raw logits each → [N, γ]."""
        W = torch.tensor(self.weights, dtype=torch.float32)  # [γ, 3]
        return W[:, 0] * z_head.float() + W[:, 1] * z_prob.float() + W[:, 2]

    def save(self, path: str | os.PathLike[str], **meta: Any) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"name": self.name, "weights": [list(r) for r in self.weights], **meta},
                                   indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HeadMaxProbConfidence:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"{path}: cannot read the head-max-prob weights ({err.strerror or err})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("name") != cls.name or "weights" not in data:
            raise ValueError(f"{path}: not a head-max-prob confidence file (needs name 'head-max-prob' and weights)")
        try:
            return cls(data["weights"])
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def fit_head_max_prob(z_head: torch.Tensor, z_prob: torch.Tensor, accepted: torch.Tensor,
                      verified: torch.Tensor | None = None, l2: float = 1e-3) -> HeadMaxProbConfidence:
    """Per position j, the logistic regression of the conditional acceptance [accepted ≥ j] on
    (z_head_j, z_prob_j, 1) over the rounds at risk there (accepted ≥ j − 1, j verified), with a
    small ridge ``l2`` on the mean log-loss. z_head, z_prob [N, γ] raw logits of the same rounds;
    accepted, verified [N]."""
    from scipy.optimize import minimize

    from dspark.metrics import conditional_labels

    if z_head.shape != z_prob.shape or z_head.ndim != 2:
        raise ValueError(f"z_head and z_prob must be [N, γ] of one shape, got {tuple(z_head.shape)} and {tuple(z_prob.shape)}")
    gamma = z_head.shape[1]
    labels, at_risk = conditional_labels(accepted, gamma, verified)  # [N, γ] each
    rows = []
    for j in range(gamma):
        k = at_risk[:, j]
        if int(k.sum()) == 0:
            raise ValueError(f"no round reached draft position {j + 1}: cannot fit its weights")
        X = torch.stack([z_head[k, j].double(), z_prob[k, j].double(), torch.ones(int(k.sum()), dtype=torch.float64)], 1)
        y = labels[k, j].double()

        def loss(w: Any, X: torch.Tensor = X, y: torch.Tensor = y) -> tuple[float, Any]:
            wt = torch.from_numpy(w)
            z = X @ wt  # [n]
            value = (torch.nn.functional.softplus(z) - y * z).mean() + l2 * (wt @ wt)  # −log σ(±z)
            grad = X.T @ (torch.sigmoid(z) - y) / len(y) + 2 * l2 * wt
            return float(value), grad.numpy()

        rows.append(tuple(minimize(loss, [0.0, 0.0, 0.0], jac=True, method="L-BFGS-B").x.tolist()))
    return HeadMaxProbConfidence(rows)


def load_confidence_model(folder: str | os.PathLike[str]) -> HeadMaxProbConfidence | None:
    """The confidence model a checkpoint folder ships in :data:`CONFIDENCE_FILE`, or None."""
    path = Path(folder) / CONFIDENCE_FILE
    return HeadMaxProbConfidence.load(path) if path.is_file() else None
