"""Compose the core parts by name: calibrate → schedule → verify, for a synthetic batch.

    python examples/schedule_and_verify.py

A real engine gets the draft block from a drafter and p from the target; here both are random so
the example runs anywhere in a second.
"""

from __future__ import annotations

import torch

import dspark
from dspark.sampling import probs_from_logits


def main() -> dict:
    R, gamma, V = 8, 7, 50
    g = torch.Generator().manual_seed(0)
    block = dspark.DraftBlock.dummy(R, gamma, V, seed=0)  # tokens [R, γ], q [R, γ, V], raw confidence [R, γ]
    target_logits = torch.randn(R, gamma + 1, V, generator=g)  # [R, γ+1, V]
    p = probs_from_logits(target_logits, temperature=1.0)  # [R, γ+1, V]

    calibrator = dspark.get_calibrator("identity")
    cost = dspark.get_cost_model("roofline", gpu="h200", num_params=8e9)  # plan for a GPU you lack
    scheduler = dspark.get_scheduler("sps-greedy")

    c = calibrator.calibrate(block.confidence_logits)  # [R, γ] per-step acceptance
    plan = scheduler.schedule(c, block.valid_lengths, cost)  # ℓ [R], τ, B, Θ
    gens = [torch.Generator().manual_seed(r) for r in range(R)]  # one stream per request
    result = dspark.verify(block.tokens, block.q, p, plan.lengths, gens)

    summary = {
        "lengths": plan.lengths.tolist(),
        "expected_tokens": plan.expected_tokens,
        "batch_size": plan.batch_size,
        "expected_tokens_per_second": plan.expected_throughput,
        "accepted": result.accepted.tolist(),
        "committed": result.committed_lists(),
    }
    for k, v in summary.items():
        print(f"{k}: {v}")
    return summary


if __name__ == "__main__":
    main()
