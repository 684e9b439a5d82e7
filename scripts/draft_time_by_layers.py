"""Draft time per round of DSpark / DFlash with N draft layers and of Eagle3 (1 layer, γ steps), on
the embedded SmolLM2 target: which N keeps a parallel drafter's round no dearer than Eagle3's.

    python scripts/draft_time_by_layers.py [--dtype bfloat16] [--layers 1 2 3 4 5] [--rounds 40]
                                            [--vocab 8192 ...] [--out docs/reports/figures/draft_time_by_layers.json]

Weights are random (time does not depend on them); the features are the target's own, captured on
a natural prompt. Each round ingests 2 new context positions (a typical τ) and drafts γ = 7 tokens
for one request (R = 1); the first round (the prompt's ingestion) is not timed. Median of
``--rounds`` rounds, runs interleaved over the configurations, repeated ``--repeats`` times.
``--vocab K``: also the 5-layer DSpark and Eagle3 cut to K tokens (:mod:`dspark.drafters.prune`;
the K kept tokens are random: the time does not depend on which).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import dspark
from dspark.protocols import DraftContext, TargetFeatures
from dspark.types import SamplingParams

PROMPT = ("Explain how Python's garbage collector decides when to free an object that is part of a "
          "reference cycle, and show a short example where a cycle keeps memory alive until a "
          "collection runs.")


def _configs(layers: list[int]) -> dict[str, tuple[str, dict]]:
    out = {f"dspark-{n}L": ("dspark", {"num_layers": n, "head": "vanilla-markov", "rank": 256}) for n in layers}
    out |= {f"dflash-{n}L": ("dflash", {"num_layers": n}) for n in layers}
    out["eagle3-1L"] = ("eagle3", {})
    return out


def _rounds(drafter, ids: torch.Tensor, feats: torch.Tensor, start: int, rounds: int) -> list[float]:
    """Draft at anchors start, start+2, ... (features of positions < anchor), timing all but the first."""
    times = []
    seen = 0
    for r in range(rounds + 1):
        a = start + 2 * r  # anchor position
        ctx = DraftContext(["r"], [ids[: a + 1]], [SamplingParams.greedy()],
                           features=TargetFeatures([feats[seen:a]]))
        t0 = time.perf_counter()
        drafter.draft(ctx)
        if r:
            times.append(time.perf_counter() - t0)
        seen = a
    drafter.release("r")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--vocab", type=int, nargs="*", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    target = dspark.load_target("smollm2-135m", dtype)
    configs = _configs(args.layers)
    drafters = {}
    for label, (kind, cfg) in configs.items():
        torch.manual_seed(0)
        drafters[label] = dspark.get_drafter(kind, target=target, gamma=args.gamma, **cfg).eval()
    from dspark.drafters.prune import prune_draft_vocab

    for k in args.vocab:
        keep = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(k))[:k]
        for label in (f"dspark-{max(args.layers)}L", "eagle3-1L"):
            drafters[f"{label}-vocab{k}"] = prune_draft_vocab(drafters[label], keep)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"][0]
    # the target's features of prompt + a greedy continuation (positions for every round)
    with torch.no_grad():
        full = target.model.generate(ids[None], max_new_tokens=2 * args.rounds + 8, do_sample=False,
                                     attention_mask=torch.ones(1, ids.numel(), dtype=torch.long))[0]
        hs = target.model(full[None], output_hidden_states=True).hidden_states
    samples: dict[str, list[float]] = {k: [] for k in drafters}
    for _ in range(args.repeats):
        for label, d in drafters.items():
            feats = torch.cat([hs[i + 1][0] for i in d.target_layer_ids], dim=-1)  # [n, m·d]
            samples[label] += _rounds(d, full, feats, ids.numel() - 1, args.rounds)
    rows = {k: {"median_ms": 1000 * statistics.median(v), "p10_ms": 1000 * sorted(v)[len(v) // 10],
                "p90_ms": 1000 * sorted(v)[9 * len(v) // 10]} for k, v in samples.items()}
    from dspark.autotune import Machine

    result = {"dtype": args.dtype, "gamma": args.gamma, "R": 1, "rounds": args.rounds, "repeats": args.repeats,
              "machine": Machine.current().describe(), "draft_ms_per_round": rows}
    for k, r in rows.items():
        print(f"{k:12s} {r['median_ms']:7.2f} ms  (p10 {r['p10_ms']:.2f}, p90 {r['p90_ms']:.2f})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
