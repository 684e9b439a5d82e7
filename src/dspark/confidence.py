"""Built-in confidence models: where raw confidence logits come from.

``draft-head`` passes through the logits of the drafter's own confidence head (DSpark), falling
back to the proxy when a drafter has none. ``max-prob`` is the documented proxy for drafters without
a head (DFlash, Eagle3, n-gram): the logit of max_v softmax(Ũ_j)(v) (of q_j when a block has no
logits). It reads Ũ_j / q_j, which depend on h_j and x̂_{j-1} only, so it keeps the stopping-rule property; a proxy built from q_j(x̂_j), the probability
of the token actually drawn, would *not* (it reads x̂_j) and is deliberately not offered.
``head-max-prob`` stacks the two per position with weights fitted on held-out rounds
(:func:`fit_head_max_prob`): the proxy alone can rank acceptance better than a trained head, and
the stack better than either (the measurements are in docs/reports/). ``stacked`` generalises it:
a per-position logistic regression over named features of the block (:data:`FEATURES`) and,
optionally, their squares, fitted by log-loss (:func:`fit_stacked`), so its logits come out calibrated (``calibrated = True``:
the engine applies no calibrator on top). The default drafter ships one as its ``confidence.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import field, frozen

from dspark.types import DraftBlock

__all__ = ["CONFIDENCE_FILE", "FEATURES", "DraftHeadConfidence", "HeadMaxProbConfidence", "MaxProbConfidence",
           "StackedConfidence", "confidence_features", "fit_head_max_prob", "fit_stacked", "load_confidence_model",
           "max_prob_logits"]

CONFIDENCE_FILE = "confidence.json"
"""A checkpoint folder's own confidence model, next to its calibration.json (fitted on its logits)."""


def _clamped_logit(p: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """logit(p) with p clamped to [eps, 1 − eps]: finite for probabilities that round to 0 or 1."""
    return torch.logit(p.clamp(eps, 1 - eps))


def max_prob_logits(q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """logit(max_v q_j(v)), clamped away from ±inf. q [R, γ, V] → [R, γ]."""
    return _clamped_logit(q.float().amax(dim=-1), eps)  # [R, γ]


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
    calibrated = False
    eps: float = field(default=1e-6)

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        return max_prob_logits(_proxy_distribution(block), self.eps)  # [R, γ]


@frozen
class DraftHeadConfidence:
    """The drafter's own confidence head; the max-prob proxy when the block carries none."""

    name = "draft-head"
    calibrated = False
    passes_head_logits = True  # the head's logits as they are (dspark.round.schedule_stop)

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
    calibrated = False  # its calibration.json (STS + bias on the stacked logits) goes on top
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
        data = _read_json(path, "head-max-prob weights")
        if not isinstance(data, dict) or data.get("name") != cls.name or "weights" not in data:
            raise ValueError(f"{path}: not a head-max-prob confidence file (needs name 'head-max-prob' and weights)")
        try:
            return cls(data["weights"])
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


@frozen
class _ProxyStats:
    """What the proxy features read of q_j = softmax(Ũ_j): the log-probabilities of its k most likely
    tokens (``top`` [R, γ, k], descending) and, only when a feature needs them all, ``logp``
    [R, γ, V]. One logsumexp and one top-k pass over the vocabulary, not a softmax and a log."""

    top: torch.Tensor
    logp: torch.Tensor | None


def _proxy_stats(block: DraftBlock, k: int, full: bool) -> _ProxyStats:
    if block.draft_logits is not None:
        U = block.draft_logits.float()  # [R, γ, V]
        lse = torch.logsumexp(U, dim=-1, keepdim=True)  # [R, γ, 1]
        top = U.topk(min(k, U.shape[-1]), dim=-1).values - lse  # [R, γ, k]
        return _ProxyStats(top, U - lse if full else None)
    logq = torch.log(block.q.float().clamp_min(1e-30))  # [R, γ, V] (a greedy q is one-hot: says little)
    return _ProxyStats(logq.topk(min(k, logq.shape[-1]), dim=-1).values, logq if full else None)


def _head(block: DraftBlock, stats: _ProxyStats | None) -> torch.Tensor:
    if block.confidence_logits is None:
        raise ValueError("the 'head' feature needs a drafter with a confidence head; this block carries none")
    return block.confidence_logits.float()  # [R, γ]


FEATURES: dict[str, Callable[[DraftBlock, Any], torch.Tensor]] = {
    "head": _head,  # the drafter's confidence-head logit
    "max-prob": lambda block, st: _clamped_logit(st.top[..., 0].exp()),  # logit max_v q_j(v)
    "margin": lambda block, st: st.top[..., 0] - st.top[..., min(1, st.top.shape[-1] - 1)],  # log q(1st) − log q(2nd)
    "neg-entropy": lambda block, st: (st.logp.exp() * st.logp).sum(-1),  # Σ_v q_j(v) log q_j(v)
    "top5-mass": lambda block, st: _clamped_logit(st.top[..., :5].exp().sum(-1)),
}
"""Confidence features of a draft block, each [R, γ], from the head logit or from the proxy
distribution q_j = softmax(Ũ_j) (of q_j itself when the block has no logits): all read h_j and
x̂_{j-1} only."""
_TOP_K = {"max-prob": 1, "margin": 2, "top5-mass": 5}  # how many of q_j's largest each reads


def _check_known(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"unknown confidence feature(s) {unknown}; known: {sorted(FEATURES)}")


def confidence_features(block: DraftBlock, names: Sequence[str]) -> torch.Tensor:
    """The named :data:`FEATURES` of a block, stacked last. → [R, γ, F]"""
    _check_known(names)
    stats = None
    if any(n != "head" for n in names):
        stats = _proxy_stats(block, max([_TOP_K.get(n, 1) for n in names]), "neg-entropy" in names)
    return torch.stack([FEATURES[n](block, stats).float() for n in names], -1)  # [R, γ, F]


def _names(value: object) -> tuple[str, ...]:
    names = tuple(value) if isinstance(value, (list, tuple)) else ()
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"features must be distinct feature names, got {value!r}")
    _check_known(names)
    return names


def _finite_rows(value: object) -> tuple[tuple[float, ...], ...]:
    try:
        rows = tuple(tuple(float(v) for v in row) for row in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"weights must be one row of numbers per draft position, got {value!r}") from None
    if not rows or not all(math.isfinite(v) for r in rows for v in r):
        raise ValueError(f"weights must be finite, one row per draft position, got {rows!r}")
    return rows


@frozen
class StackedConfidence:
    """Per position j the logit w_j · [x̃, x̃², 1] with x̃ = (x_j − center) / scale the block's named
    ``features`` at j (:data:`FEATURES`; the squares only with ``squares``). Fitted by log-loss on
    held-out rounds (:func:`fit_stacked`), its logits are calibrated as they come (``calibrated``):
    the engine applies no calibrator on top. Every feature reads h_j and x̂_{j-1} only, so the
    stopping-rule property holds. γ = len(weights)."""

    name = "stacked"
    calibrated = True
    features: tuple[str, ...] = field(converter=_names)
    weights: tuple[tuple[float, ...], ...] = field(converter=_finite_rows)
    center: tuple[float, ...] = field(converter=lambda v: tuple(float(x) for x in v))
    scale: tuple[float, ...] = field(converter=lambda v: tuple(float(x) for x in v))
    squares: bool = field(default=True)

    def __attrs_post_init__(self) -> None:
        k = len(self.features)
        if len(self.center) != k or len(self.scale) != k or not all(s > 0 for s in self.scale):
            raise ValueError(f"center and scale need one entry per feature ({k}), scale > 0; "
                             f"got {self.center!r} and {self.scale!r}")
        m = k * (1 + self.squares) + 1
        if any(len(r) != m for r in self.weights):
            raise ValueError(f"each weights row needs {m} entries ({k} features"
                             f"{', their squares' if self.squares else ''} and a bias), got {[len(r) for r in self.weights]}")

    @classmethod
    def create(cls, path: str | os.PathLike[str] | None = None, **fields: Any) -> StackedConfidence:
        """The registered factory: from a JSON file written by :meth:`save`, or from the fields."""
        if (path is None) == (not fields):
            raise ValueError("stacked takes path= (a confidence.json) or its fields (features, weights, center, "
                             "scale[, squares]), not both")
        return cls.load(path) if path is not None else cls(**fields)

    def design(self, X: torch.Tensor) -> torch.Tensor:
        """[x̃, x̃², 1] per row and position. X [N, γ, F] → [N, γ, m]"""
        c = torch.tensor(self.center, dtype=X.dtype)
        s = torch.tensor(self.scale, dtype=X.dtype)
        Z = (X - c) / s  # [N, γ, F]
        parts = [Z, Z * Z] if self.squares else [Z]
        return torch.cat([*parts, torch.ones_like(Z[..., :1])], -1)  # [N, γ, m]

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """The stacked logits of recorded features. X [N, γ, F] → [N, γ]"""
        if X.ndim != 3 or X.shape[1] != len(self.weights) or X.shape[2] != len(self.features):
            raise ValueError(f"stacked was fitted for γ = {len(self.weights)} draft positions and "
                             f"{len(self.features)} features; got features of shape {tuple(X.shape)}")
        W = torch.tensor(self.weights, dtype=torch.float64)  # [γ, m]
        return (self.design(X.double()) * W).sum(-1).float()  # [N, γ]

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor:
        return self.apply(confidence_features(block, self.features))  # [R, γ]

    def save(self, path: str | os.PathLike[str], **meta: Any) -> Path:
        path = Path(path)
        data = {"name": self.name, "features": list(self.features), "squares": self.squares,
                "center": list(self.center), "scale": list(self.scale),
                "weights": [list(r) for r in self.weights], **meta}
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StackedConfidence:
        data = _read_json(path, "stacked confidence")
        if not isinstance(data, dict) or data.get("name") != cls.name:
            raise ValueError(f"{path}: not a stacked confidence file (needs name 'stacked')")
        try:
            return cls(data["features"], data["weights"], data["center"], data["scale"], bool(data.get("squares", True)))
        except KeyError as err:
            raise ValueError(f"{path}: a stacked confidence file needs {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _logistic_rows(X: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor | None,
                   l2: float) -> list[tuple[float, ...]]:
    """Per position j, the logistic regression of the conditional acceptance [accepted ≥ j] on the
    columns of X[:, j] over the rounds at risk there (accepted ≥ j − 1, j verified), with a ridge
    ``l2`` on the mean log-loss (the last column, the intercept, is not penalised).
    X [N, γ, m] (its last column all ones); accepted, verified [N] → γ rows of m weights."""
    from scipy.optimize import minimize

    from dspark.metrics import conditional_labels

    gamma, m = X.shape[1], X.shape[2]
    labels, at_risk = conditional_labels(accepted, gamma, verified)  # [N, γ] each
    ridge = torch.ones(m, dtype=torch.float64)
    ridge[-1] = 0.0  # [m]
    rows = []
    for j in range(gamma):
        k = at_risk[:, j]
        if int(k.sum()) == 0:
            raise ValueError(f"no round reached draft position {j + 1}: cannot fit its weights")
        Z, y = X[k, j].double(), labels[k, j].double()  # [n, m], [n]

        def loss(w: Any, Z: torch.Tensor = Z, y: torch.Tensor = y) -> tuple[float, Any]:
            wt = torch.from_numpy(w)
            z = Z @ wt  # [n]
            value = (torch.nn.functional.softplus(z) - y * z).mean() + l2 * (ridge * wt * wt).sum()  # −log σ(±z)
            grad = Z.T @ (torch.sigmoid(z) - y) / len(y) + 2 * l2 * ridge * wt
            return float(value), grad.numpy()

        rows.append(tuple(minimize(loss, [0.0] * m, jac=True, method="L-BFGS-B").x.tolist()))
    return rows


def fit_head_max_prob(z_head: torch.Tensor, z_prob: torch.Tensor, accepted: torch.Tensor,
                      verified: torch.Tensor | None = None, l2: float = 1e-3) -> HeadMaxProbConfidence:
    """Per position j, the logistic regression of the conditional acceptance [accepted ≥ j] on
    (z_head_j, z_prob_j, 1) over the rounds at risk there (accepted ≥ j − 1, j verified), with a
    small ridge ``l2`` on the mean log-loss. z_head, z_prob [N, γ] raw logits of the same rounds;
    accepted, verified [N]."""
    if z_head.shape != z_prob.shape or z_head.ndim != 2:
        raise ValueError(f"z_head and z_prob must be [N, γ] of one shape, got {tuple(z_head.shape)} and {tuple(z_prob.shape)}")
    X = torch.stack([z_head.double(), z_prob.double(), torch.ones_like(z_head, dtype=torch.float64)], -1)  # [N, γ, 3]
    return HeadMaxProbConfidence(_logistic_rows(X, accepted, verified, l2))


def fit_stacked(X: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor | None = None, *,
                features: Sequence[str], squares: bool = True, l2: float = 1e-3) -> StackedConfidence:
    """A :class:`StackedConfidence` over ``features`` fitted on recorded rounds: X [N, γ, F] the
    features of each round (:func:`confidence_features`, in the order of ``features``), accepted and
    verified [N]. Features are standardised over all rounds and positions first (``center``,
    ``scale``) so that one ridge ``l2`` suits them all."""
    X = torch.as_tensor(X, dtype=torch.float64)
    if X.ndim != 3 or X.shape[2] != len(features):
        raise ValueError(f"X must be [N, γ, F={len(features)}] (one column per feature), got {tuple(X.shape)}")
    flat = X.reshape(-1, X.shape[2])  # [N·γ, F]
    center, scale = flat.mean(0), flat.std(0).clamp_min(1e-6)  # [F] each
    model = StackedConfidence(tuple(features), [[0.0] * (len(features) * (1 + squares) + 1)] * X.shape[1],
                              center.tolist(), scale.tolist(), squares)
    return attrs.evolve(model, weights=_logistic_rows(model.design(X), accepted, verified, l2))


def load_confidence_model(folder: str | os.PathLike[str]) -> HeadMaxProbConfidence | StackedConfidence | None:
    """The confidence model a checkpoint folder ships in :data:`CONFIDENCE_FILE` (``stacked`` or
    ``head-max-prob``, by the file's name), or None."""
    path = Path(folder) / CONFIDENCE_FILE
    if not path.is_file():
        return None
    data = _read_json(path, "confidence model")
    kinds = {c.name: c for c in (StackedConfidence, HeadMaxProbConfidence)}
    kind = kinds.get(data.get("name")) if isinstance(data, dict) else None
    if kind is None:
        raise ValueError(f"{path}: not a confidence model file (name must be one of {sorted(kinds)})")
    return kind.load(path)
