"""Parity between a PyTorch drafter and the same drafter run from its exported graphs.

:func:`compare_drafters` feeds both the same synthetic rounds — requests of different lengths
(one of them a one-token prompt), random target features, a second round after some drafts were
"accepted" (incremental context), then a sampled round with identically seeded per-request
generators — and reports the largest differences. ``python -m dspark.export --validate`` and the
tests use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from dspark.drafters.vocab import NEG
from dspark.protocols.drafter import DraftContext
from dspark.types import SamplingParams

__all__ = ["ParityReport", "compare_drafters"]


@attrs.frozen
class ParityReport:
    max_abs_logits: float  # draft (head-corrected) logits, all rounds
    logit_scale: float  # max |logit| of the reference, for a relative reading
    max_abs_confidence: float | None
    max_abs_hidden: float | None
    greedy_tokens_equal: bool
    sampled_tokens_equal: bool
    rounds: int
    requests: int

    def passed(self, atol: float) -> bool:
        return (self.max_abs_logits <= atol and self.greedy_tokens_equal
                and (self.max_abs_confidence is None or self.max_abs_confidence <= atol))

    def summary(self) -> str:
        conf = "" if self.max_abs_confidence is None else f", confidence {self.max_abs_confidence:.2e}"
        return (f"max |Δ logits| {self.max_abs_logits:.2e} (logits up to {self.logit_scale:.1f}){conf}; "
                f"greedy drafts {'identical' if self.greedy_tokens_equal else 'DIFFER'}, sampled drafts "
                f"{'identical' if self.sampled_tokens_equal else 'differ'} "
                f"({self.requests} requests × {self.rounds} rounds)")


def _maxdiff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float().cpu() - b.float().cpu()).abs().max())


@torch.inference_mode()
def compare_drafters(
    reference: Any,
    exported: Any,
    *,
    prompt_lengths: Sequence[int] = (1, 6, 13),
    seed: int = 0,
) -> ParityReport:
    """Run ``reference`` (PyTorch) and ``exported`` on the same three rounds; compare."""
    gen = torch.Generator().manual_seed(seed)
    V = reference.vocab_size
    F_in = len(reference.target_layer_ids) * reference.config.layer.hidden_size
    rids = [f"parity-{seed}-{i}" for i in range(len(prompt_lengths))]
    tokens = [torch.randint(0, V, (n,), generator=gen) for n in prompt_lengths]
    seen = [0] * len(tokens)
    diffs = {"logits": 0.0, "conf": None, "hidden": None}
    scale, greedy_eq, sampled_eq = 0.0, True, True
    schedule = ["greedy", "greedy", "sampled"]
    try:
        for rnd, mode in enumerate(schedule):
            feats = [torch.randn(t.numel() - 1 - s, F_in, generator=gen) for t, s in zip(tokens, seen)]
            seen = [t.numel() - 1 for t in tokens]
            if mode == "greedy":
                sampling, gens_a, gens_b = [SamplingParams()] * len(tokens), None, None
            else:
                sampling = [SamplingParams(temperature=1.0)] * len(tokens)
                gens_a = [torch.Generator().manual_seed(100 + i) for i in range(len(tokens))]
                gens_b = [torch.Generator().manual_seed(100 + i) for i in range(len(tokens))]
            a = reference.draft(DraftContext(rids, tokens, sampling, gens_a, features={"hidden": feats}))
            b = exported.draft(DraftContext(rids, tokens, sampling, gens_b, features={"hidden": feats}))
            diffs["logits"] = max(diffs["logits"], _maxdiff(a.draft_logits, b.draft_logits))
            real = a.draft_logits[a.draft_logits > NEG / 2]  # not the "outside the draft vocabulary" fill
            scale = max(scale, float(real.abs().max()))
            for key, x, y in (("conf", a.confidence_logits, b.confidence_logits), ("hidden", a.hidden, b.hidden)):
                d = _maxdiff(x, y)
                if d is not None:
                    diffs[key] = max(diffs[key] or 0.0, d)
            same = bool(torch.equal(a.tokens, b.tokens))
            if mode == "greedy":
                greedy_eq &= same
            else:
                sampled_eq &= same
            # Commit a few of the reference's drafts plus one "recovered" token, varying per request.
            tokens = [
                torch.cat([t, a.tokens[i, : (i + rnd) % (a.gamma + 1)], torch.randint(0, V, (1,), generator=gen)])
                for i, t in enumerate(tokens)
            ]
    finally:
        for rid in rids:
            reference.release(rid)
            exported.release(rid)
    return ParityReport(
        max_abs_logits=diffs["logits"], logit_scale=scale, max_abs_confidence=diffs["conf"],
        max_abs_hidden=diffs["hidden"], greedy_tokens_equal=greedy_eq, sampled_tokens_equal=sampled_eq,
        rounds=len(schedule), requests=len(prompt_lengths),
    )
