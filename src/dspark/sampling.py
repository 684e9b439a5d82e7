"""Turning logits into the distributions p and q, and drawing from them.

Terms: R requests, n positions per request, V vocabulary entries. Temperature T, top-k and top-p
are per request and are applied *identically* to the target's logits (giving p) and the draft's
logits (giving q) — verification is lossless only when q is the distribution the draft token was
really drawn from. T = 0 is greedy: the distribution is one-hot at the argmax, which makes the
rejection sampler in :mod:`dspark.verify` reduce exactly to "accept iff x̂ = argmax p".

Every random draw takes an explicit ``torch.Generator`` — one shared by the batch, or one per
request so that a request's output does not depend on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.types import SamplingParams, stack_sampling_params

__all__ = ["probs_from_logits", "sample", "uniform", "exponential", "Generators"]

Generators = torch.Generator | Sequence[torch.Generator] | None


def _per_row(value: torch.Tensor | float | int, R: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype)
    return t.expand(R) if t.ndim == 0 else t  # [R]


def probs_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Distribution over the vocabulary after temperature, top-k and top-p.

    ``logits`` [R, n, V] or [R, V]; ``temperature``, ``top_k``, ``top_p`` scalars or per-request
    [R] tensors (top_k = 0 and top_p = 1 disable the filter; T = 0 gives the one-hot argmax).
    Returns float32 probabilities of the same shape as ``logits``.
    """
    squeeze = logits.ndim == 2
    x = logits.float().unsqueeze(1) if squeeze else logits.float()  # [R, n, V]
    R, _, V = x.shape
    T = _per_row(temperature, R, torch.float32)  # [R]
    k = _per_row(top_k, R, torch.long)  # [R]
    top_p_r = _per_row(top_p, R, torch.float32)  # [R]
    greedy = T == 0  # [R]

    x = x / torch.where(greedy, 1.0, T)[:, None, None]  # [R, n, V]
    if bool(((k > 0) & (k < V)).any()) or bool((top_p_r < 1).any()):
        x = _filter_top_k_top_p(x, k, top_p_r)
    probs = torch.softmax(x, dim=-1)  # [R, n, V]
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.float().reshape(R, -1, V).argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs.squeeze(1) if squeeze else probs


def _filter_top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf. x [R, n, V]; k [R]; top_p [R]."""
    V = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [R, n, V]
    rank = torch.arange(V)  # [V]
    k_eff = torch.where((k > 0) & (k < V), k, V)  # [R]
    drop = rank[None, None, :] >= k_eff[:, None, None]  # [R, n, V]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    # Nucleus over what top-k kept: keep a token while the mass *before* it is < top_p, so the
    # most likely token always survives.
    sorted_p = torch.softmax(sorted_x, dim=-1)  # [R, n, V]
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [R, n, V]
    drop = mass_before >= top_p[:, None, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def probs_for_requests(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``probs_from_logits`` with one SamplingParams per request. logits [R, n, V] or [R, V]."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {logits.shape[0]} requests")
    T, k, p = stack_sampling_params(params)
    return probs_from_logits(logits, T, k, p)


def uniform(R: int, n: int, generators: Generators) -> torch.Tensor:
    """U[0, 1) draws [R, n]; row r from ``generators[r]`` when a sequence is given."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(R, n, generator=generators)
    _check_count(generators, R)
    return torch.stack([torch.rand(n, generator=g) for g in generators]) if R else torch.empty(0, n)


def exponential(R: int, n: int, generators: Generators) -> torch.Tensor:
    """Exp(1) draws [R, n]; row r from ``generators[r]`` when a sequence is given."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.empty(R, n).exponential_(generator=generators)
    _check_count(generators, R)
    if R == 0:
        return torch.empty(0, n)
    return torch.stack([torch.empty(n).exponential_(generator=g) for g in generators])


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] → [R] int64.

    Uses the exponential race argmax_v p(v) / E_v with E_v ~ Exp(1), which draws exactly from p
    (P(v wins) = p(v)), needs no normalisation and lets each row use its own generator.
    Rows that are one-hot come out deterministic, so greedy rows need no special case.
    """
    R, V = probs.shape
    E = exponential(R, V, generators)  # [R, V]
    return (probs / E).argmax(dim=-1)


def _check_count(generators: Sequence[torch.Generator], R: int) -> None:
    if len(generators) != R:
        raise ValueError(f"{len(generators)} generators for {R} requests")
