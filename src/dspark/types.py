"""Values that cross the protocol boundaries.

Every value is an attrs ``@frozen`` class validated at construction. Tensor fields carry their
shape in a comment, with the symbols of docs/concepts.md:

* R — requests in the batch, γ — draft block size, V — vocabulary size.
* ℓ_r — verified prefix length chosen by the scheduler, 0 ≤ ℓ_r ≤ γ.
* a_{r,j} — prefix survival probability Π_{i≤j} c_{r,i}.

Each batch value has a ``dummy(...)`` constructor for tests and tracing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from attrs import field, frozen

__all__ = ["SamplingParams", "DraftBlock", "Schedule", "VerifyResult"]


def _check_tensor(name: str, value: object, ndim: int, dtype_kind: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if dtype_kind == "int" and (value.dtype.is_floating_point or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if dtype_kind == "float" and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if dtype_kind == "bool" and value.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {value.dtype}")


# --------------------------------------------------------------------------------------------
# Sampling parameters
# --------------------------------------------------------------------------------------------


def _check_temperature(_inst: object, _attr: object, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"temperature must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {value}")


def _check_top_k(_inst: object, _attr: object, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {value!r}")


def _check_top_p(_inst: object, _attr: object, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 < value <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {value!r}")


@frozen
class SamplingParams:
    """How one request samples. The same parameters shape p (target) and q (draft).

    ``temperature == 0`` is greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those
    filters.
    """

    temperature: float = field(default=0.0, validator=_check_temperature)
    top_k: int = field(default=0, validator=_check_top_k)
    top_p: float = field(default=1.0, validator=_check_top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)

    @classmethod
    def random(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
        if temperature == 0:
            raise ValueError("SamplingParams.random needs temperature > 0; use greedy() for T=0")
        return cls(temperature=temperature, top_k=top_k, top_p=top_p)


# --------------------------------------------------------------------------------------------
# Draft block
# --------------------------------------------------------------------------------------------


@frozen
class DraftBlock:
    """What a drafter proposes for R requests in one round.

    ``q`` is the distribution each draft token was *actually sampled from* (after the sequential
    head and the request's temperature / top-k / top-p). Verification is lossless only with that q.
    ``confidence_logits`` are raw (uncalibrated) logits of c_{r,j}; by the stopping-rule argument
    (docs/concepts.md §5) position j's logit may depend on h_j and x̂_{j-1}, never on x̂_j. ``None`` means
    the drafter has no confidence head; a ConfidenceModel proxy fills in.
    """

    tokens: torch.Tensor = field()  # [R, γ] int64 draft tokens x̂_1..x̂_γ
    q: torch.Tensor = field()  # [R, γ, V] float draft distributions q_1..q_γ
    valid_lengths: torch.Tensor = field()  # [R] int64, draft positions that exist (≤ γ)
    confidence_logits: torch.Tensor | None = field(default=None)  # [R, γ] float raw logits
    draft_logits: torch.Tensor | None = field(default=None)  # [R, γ, V] corrected logits Ũ_j
    hidden: torch.Tensor | None = field(default=None)  # [R, γ, d] backbone states h_j

    def __attrs_post_init__(self) -> None:
        _check_tensor("DraftBlock.tokens", self.tokens, 2, "int")
        _check_tensor("DraftBlock.q", self.q, 3, "float")
        _check_tensor("DraftBlock.valid_lengths", self.valid_lengths, 1, "int")
        R, gamma = self.tokens.shape
        if self.q.shape[:2] != (R, gamma):
            raise ValueError(
                f"DraftBlock.q has shape {tuple(self.q.shape)}; expected [R={R}, γ={gamma}, V]"
            )
        if self.valid_lengths.shape != (R,):
            raise ValueError(f"DraftBlock.valid_lengths must have shape [{R}]")
        if R and (int(self.valid_lengths.min()) < 0 or int(self.valid_lengths.max()) > gamma):
            raise ValueError(f"DraftBlock.valid_lengths must lie in [0, γ={gamma}]")
        if self.confidence_logits is not None:
            _check_tensor("DraftBlock.confidence_logits", self.confidence_logits, 2, "float")
            if self.confidence_logits.shape != (R, gamma):
                raise ValueError(f"DraftBlock.confidence_logits must have shape [{R}, {gamma}]")
        if self.draft_logits is not None and self.draft_logits.shape != self.q.shape:
            raise ValueError("DraftBlock.draft_logits must have the shape of q [R, γ, V]")
        if self.hidden is not None and self.hidden.shape[:2] != (R, gamma):
            raise ValueError(f"DraftBlock.hidden must have shape [{R}, {gamma}, d]")

    @property
    def num_requests(self) -> int:
        return self.tokens.shape[0]

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.q.shape[2]

    def with_confidence(self, confidence_logits: torch.Tensor) -> DraftBlock:
        return attrs.evolve(self, confidence_logits=confidence_logits)

    @classmethod
    def dummy(
        cls,
        num_requests: int = 2,
        gamma: int = 4,
        vocab_size: int = 8,
        *,
        seed: int = 0,
        with_confidence: bool = True,
    ) -> DraftBlock:
        """A random, internally consistent block: tokens are sampled from q."""
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(num_requests, gamma, vocab_size, generator=g)  # [R, γ, V]
        q = torch.softmax(logits, dim=-1)  # [R, γ, V]
        tokens = torch.multinomial(q.reshape(-1, vocab_size), 1, generator=g).reshape(
            num_requests, gamma
        )  # [R, γ]
        conf = torch.randn(num_requests, gamma, generator=g) if with_confidence else None
        return cls(
            tokens=tokens,
            q=q,
            valid_lengths=torch.full((num_requests,), gamma, dtype=torch.long),
            confidence_logits=conf,
            draft_logits=logits,
        )


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


@frozen
class Schedule:
    """The scheduler's decision for one round: how many draft tokens of each request to verify.

    ``expected_tokens`` τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}); ``batch_size`` B is the verification batch
    in tokens under the cost model's accounting (packed Σ(1+ℓ) or padded R·(1+max ℓ));
    ``expected_throughput`` Θ = τ · SPS(B) in tokens per second (``nan`` without a cost model).
    """

    lengths: torch.Tensor = field()  # [R] int64 ℓ_r
    survival: torch.Tensor = field()  # [R, γ] float a_{r,j}
    expected_tokens: float = field()
    batch_size: int = field()
    expected_throughput: float = field(default=math.nan)

    def __attrs_post_init__(self) -> None:
        _check_tensor("Schedule.lengths", self.lengths, 1, "int")
        _check_tensor("Schedule.survival", self.survival, 2, "float")
        if self.survival.shape[0] != self.lengths.shape[0]:
            raise ValueError("Schedule.survival and Schedule.lengths disagree on R")
        gamma = self.survival.shape[1]
        if self.lengths.numel() and not (
            0 <= int((mm := torch.aminmax(self.lengths)).min) and int(mm.max) <= gamma
        ):
            raise ValueError(f"Schedule.lengths must lie in [0, γ={gamma}]")

    @property
    def num_requests(self) -> int:
        return self.lengths.shape[0]

    @classmethod
    def dummy(cls, num_requests: int = 2, gamma: int = 4, *, seed: int = 0) -> Schedule:
        g = torch.Generator().manual_seed(seed)
        c = torch.rand(num_requests, gamma, generator=g)  # [R, γ]
        a = torch.cumprod(c, dim=1)  # [R, γ]
        lengths = torch.randint(0, gamma + 1, (num_requests,), generator=g)  # [R]
        mask = torch.arange(gamma)[None, :] < lengths[:, None]  # [R, γ]
        tau = float(num_requests + (a * mask).sum())
        return cls(lengths, a, tau, int(num_requests + lengths.sum()))


# --------------------------------------------------------------------------------------------
# Verification result
# --------------------------------------------------------------------------------------------


@frozen
class VerifyResult:
    """The outcome of verifying R requests.

    Request r commits ``num_committed[r] = accepted[r] + 1`` tokens: its first ``accepted[r]``
    draft tokens, then ``next_tokens[r]`` — the recovered token (sampled from
    norm(max(0, p − q)) at the first rejection) or, when all ℓ_r verified drafts passed, the bonus
    token (sampled from p_{ℓ_r + 1}).
    """

    accepted: torch.Tensor = field()  # [R] int64 accepted draft tokens, ≤ ℓ_r
    accept_flags: torch.Tensor = field()  # [R, γ] bool: position j accepted (j < accepted[r])
    next_tokens: torch.Tensor = field()  # [R] int64 recovered or bonus token
    is_bonus: torch.Tensor = field()  # [R] bool: next_tokens[r] is a bonus token
    committed: torch.Tensor = field()  # [R, γ+1] int64 committed tokens, right-padded with -1

    def __attrs_post_init__(self) -> None:
        _check_tensor("VerifyResult.accepted", self.accepted, 1, "int")
        _check_tensor("VerifyResult.accept_flags", self.accept_flags, 2, "bool")
        _check_tensor("VerifyResult.next_tokens", self.next_tokens, 1, "int")
        _check_tensor("VerifyResult.committed", self.committed, 2, "int")

    @property
    def num_committed(self) -> torch.Tensor:  # [R] τ_r for this round
        return self.accepted + 1

    def committed_lists(self) -> list[list[int]]:
        """Committed tokens per request as Python lists (padding removed)."""
        return [row[: int(n)].tolist() for row, n in zip(self.committed, self.num_committed)]

    @classmethod
    def dummy(cls, num_requests: int = 2, gamma: int = 4, *, seed: int = 0) -> VerifyResult:
        g = torch.Generator().manual_seed(seed)
        accepted = torch.randint(0, gamma + 1, (num_requests,), generator=g)  # [R]
        flags = torch.arange(gamma)[None, :] < accepted[:, None]  # [R, γ]
        next_tokens = torch.randint(0, 8, (num_requests,), generator=g)  # [R]
        committed = torch.full((num_requests, gamma + 1), -1, dtype=torch.long)  # [R, γ+1]
        for r in range(num_requests):
            n = int(accepted[r])
            committed[r, :n] = torch.randint(0, 8, (n,), generator=g)
            committed[r, n] = next_tokens[r]
        return cls(accepted, flags, next_tokens, accepted == gamma, committed)


def stack_sampling_params(
    params: Sequence[SamplingParams],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request sampling parameters as tensors: temperature [R], top_k [R], top_p [R]."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    return temperature, top_k, top_p
