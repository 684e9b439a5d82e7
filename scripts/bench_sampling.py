"""Per-step sampling cost on the real target's logits: dspark's sampler against the one it replaced.

    python scripts/bench_sampling.py --requests 48 --repeats 5 --out docs/reports/figures/bench_sampling.json

The target (bf16 SmolLM2-135M) reads R natural prompts; the logits at their last positions are the
rows. Each side turns them into p under T = 0.7, top-p = 0.95 (`dspark data`'s defaults) and draws
one token per row with one generator per request:

* ``previous`` — the nucleus by a full sort of the vocabulary and the exponential race
  argmax p / E with E from ``Tensor.exponential_`` (dspark before commit f27efb5);
* ``current`` — ``dspark.sampling``: the nucleus decided on the 1024 leading logits (full sort only
  where they cannot decide it) and the same race with E = −log(1 − U).

Both sides alternate within each repeat; the medians and their ratio are printed and written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def previous_sampler(logits: torch.Tensor, T: float, top_p: float, gens: list[torch.Generator]) -> torch.Tensor:
    x = logits.float() / T  # [R, V]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
    x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    p = torch.softmax(x, dim=-1)
    E = torch.stack([torch.empty(p.shape[1]).exponential_(generator=g) for g in gens])
    return (p / E).argmax(-1)


def current_sampler(logits: torch.Tensor, T: float, top_p: float, gens: list[torch.Generator]) -> torch.Tensor:
    from dspark.sampling import probs_from_logits, sample

    return sample(probs_from_logits(logits, T, 0, top_p), gens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="sampling calls timed per repeat and side")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from dspark.engine import encode_prompt
    from dspark.evaluation.inputs import eval_prompts
    from dspark.targets import load_target

    torch.manual_seed(0)
    target = load_target("smollm2-135m", dtype=torch.bfloat16)
    prompts = eval_prompts("src/dspark/data/natural_eval.jsonl", 40)[: args.requests]
    rows = []
    with torch.inference_mode():
        for p in prompts:
            msgs = [{"role": r, "content": c} for r, c in p.messages] if p.messages else p.text
            ids = encode_prompt(target.tokenizer, msgs)[None, :]
            rows.append(target.model(ids).logits[0, -1].float())
    logits = torch.stack(rows)  # [R, V]
    nucleus = (torch.softmax(logits / 0.7, -1).sort(-1, descending=True).values.cumsum(-1) < 0.95).sum(-1) + 1
    times: dict[str, list[float]] = {"previous": [], "current": []}
    for _ in range(args.repeats):
        for name, fn in (("previous", previous_sampler), ("current", current_sampler)):
            gens = [torch.Generator().manual_seed(i) for i in range(len(rows))]
            fn(logits, 0.7, 0.95, gens)  # warm-up
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn(logits, 0.7, 0.95, gens)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"requests": len(rows), "temperature": 0.7, "top_p": 0.95, "threads": torch.get_num_threads(),
              "nucleus_size": {"median": int(nucleus.median()), "max": int(nucleus.max())},
              "ms_per_step": times, "median_ms": med, "speedup": med["previous"] / med["current"],
              "command": "python scripts/bench_sampling.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    print(json.dumps({k: result[k] for k in ("nucleus_size", "median_ms", "speedup")}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
