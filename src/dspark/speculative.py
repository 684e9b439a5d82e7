"""A reference speculative decoding loop for one request on an HF causal LM.

Each round (:func:`dspark.round.speculative_round`, the same round the batched engine runs):
draft → confidence → calibrate → schedule → one target forward over [anchor, x̂_1..x̂_ℓ] (here:
an HF model with a DynamicCache) → verify → commit → crop the KV cache back to the committed
prefix. It shares the round with the engine, not the target-side bookkeeping (one request, no
padding, no continuous batching), so engine tests can compare the two.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from attrs import define, field

from dspark.models import cache_kwarg, crop_cache
from dspark.protocols import (
    Calibrator,
    ConfidenceModel,
    CostModel,
    DraftContext,
    Drafter,
    Scheduler,
)
from dspark.round import speculative_round
from dspark.types import SamplingParams

__all__ = ["RoundStats", "speculative_generate", "plain_generate"]


@define
class RoundStats:
    rounds: int = 0
    proposed: list[int] = field(factory=list)  # valid draft length per round
    verified: list[int] = field(factory=list)  # ℓ per round
    accepted: list[int] = field(factory=list)  # accepted draft tokens per round
    confidence_logits: list[torch.Tensor] = field(factory=list)  # raw [γ] per round
    target_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean committed tokens per round (accepted + 1)."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "mean_proposed": sum(self.proposed) / max(self.rounds, 1),
            "mean_verified": sum(self.verified) / max(self.rounds, 1),
            "accepted_tokens": sum(self.accepted),
            "target_seconds": self.target_seconds,
            "total_seconds": self.total_seconds,
        }


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    out = model(input_ids=ids[None, :], use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0]  # [n, V]


@torch.inference_mode()
def speculative_generate(
    model,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    scheduler: Scheduler,
    *,
    confidence_model: ConfidenceModel,
    calibrator: Calibrator,
    cost_model: CostModel | None,
    params: SamplingParams | None = None,
    max_new_tokens: int = 64,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], RoundStats]:
    """Generate up to ``max_new_tokens`` for one prompt [n] with speculative decoding."""
    from transformers import DynamicCache

    if prompt_ids.numel() == 0:
        raise ValueError("the prompt is empty")
    params = params or SamplingParams.greedy()
    stats = RoundStats()
    t_start = time.perf_counter()
    cache = DynamicCache()
    seq = prompt_ids.long().clone()
    if seq.numel() > 1:
        _forward(model, seq[:-1], cache)  # prefill all but the anchor
    out: list[int] = []
    while len(out) < max_new_tokens:
        room = max_new_tokens - len(out) - 1  # the round always commits one target token too
        ctx = DraftContext(["r0"], [seq], [params], [generator] if generator else None,
                           max_lengths=torch.tensor([room]))

        def verify_fn(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[None, torch.Tensor]:
            ell = int(lengths[0])
            logits = _forward(model, tokens[0, : 1 + ell], cache)  # [1 + ℓ, V]
            padded = logits.new_zeros(tokens.shape[1], logits.shape[-1])  # [1 + γ, V], zero beyond 1 + ℓ
            padded[: ell + 1] = logits
            return None, padded[None]

        res = speculative_round(ctx, verify_fn, drafter=drafter, confidence_model=confidence_model,
                                calibrator=calibrator, scheduler=scheduler, cost_model=cost_model)
        stats.target_seconds += res.verify_seconds
        n_acc = int(res.accepted[0])
        committed = res.committed[0, : n_acc + 1].tolist()
        # The cache holds the old prefix + anchor + ℓ drafts; keep only anchor + accepted drafts.
        crop_cache(cache, seq.numel() + n_acc)
        stats.rounds += 1
        stats.proposed.append(int(res.block.valid_lengths[0]))
        stats.verified.append(int(res.lengths[0]))
        stats.accepted.append(n_acc)
        stats.confidence_logits.append(res.confidence_logits[0])
        if eos_token_id is not None and eos_token_id in committed:
            committed = committed[: committed.index(eos_token_id) + 1]
        out.extend(committed)
        seq = torch.cat([seq, torch.tensor(committed)])
        if eos_token_id is not None and committed[-1] == eos_token_id:
            break
    stats.total_seconds = time.perf_counter() - t_start
    return out[:max_new_tokens], stats


@torch.inference_mode()
def plain_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target's own greedy decode (HF ``generate``): the reference for token identity."""
    ids = prompt_ids[None, :].to(model.device)  # [1, n]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
    )
    return out[0, prompt_ids.numel():].tolist()
