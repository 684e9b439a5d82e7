"""Paired comparison of two drafters evaluated together by `dspark eval` (same prompts, same target):
per-domain τ, and the per-prompt difference of τ with a bootstrap 95 % interval over prompts.

    python scripts/compare_eval.py /work/runs/eval-d15 dspark-5l-xl dspark-5l-d15 [--temperature 0]

τ of a prompt = mean over its rounds of (accepted + 1), as `dspark eval` computes it per domain.
The bootstrap resamples prompts with replacement (10,000 resamples, seed 0: the same interval on
every run). A drafter is "ahead" on a prompt when its τ there is strictly higher.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from dspark.evaluation.eval_run import rounds_path


def per_prompt_tau(rounds_file: Path) -> tuple[dict[int, float], dict[int, str]]:
    """{prompt index: τ}, {prompt index: domain} from one `dspark eval` rounds file."""
    r = json.loads(rounds_file.read_text())
    acc: dict[int, list[int]] = defaultdict(list)
    dom: dict[int, str] = {}
    for p, a, d in zip(r["prompt"], r["accepted"], r["domain"]):
        acc[p].append(a + 1)
        dom[p] = d
    return {p: float(np.mean(v)) for p, v in acc.items()}, dom


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("a", help="the baseline drafter's label")
    ap.add_argument("b", help="the drafter compared with it")
    ap.add_argument("--temperature", default="0.0")
    ap.add_argument("--resamples", type=int, default=10_000)
    args = ap.parse_args(argv)
    files = {x: rounds_path(args.eval_dir, x, float(args.temperature)) for x in (args.a, args.b)}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        print(f"no rounds file {', '.join(missing)} (labels and temperature as `dspark eval` wrote them)",
              file=sys.stderr)
        return 2
    (ta, dom), (tb, _) = per_prompt_tau(files[args.a]), per_prompt_tau(files[args.b])
    prompts = sorted(set(ta) & set(tb))
    if set(ta) != set(tb):
        print(f"warning: the runs share {len(prompts)} of {len(set(ta) | set(tb))} prompts", file=sys.stderr)
    diff = np.array([tb[p] - ta[p] for p in prompts])  # [P]
    rng = np.random.default_rng(0)
    boot = diff[rng.integers(0, len(diff), size=(args.resamples, len(diff)))].mean(axis=1)  # [resamples]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    print(f"| domain | prompts | {args.a}: mean per-prompt τ | {args.b}: mean per-prompt τ | difference |")
    print("|---|---|---|---|---|")
    for d in sorted({dom[p] for p in prompts}):
        ps = [p for p in prompts if dom[p] == d]
        print(f"| {d} | {len(ps)} | {np.mean([ta[p] for p in ps]):.3f} | {np.mean([tb[p] for p in ps]):.3f} "
              f"| {np.mean([tb[p] - ta[p] for p in ps]):+.3f} |")
    print(f"\n{args.b} − {args.a}, per prompt: mean {diff.mean():+.3f} τ, bootstrap 95 % interval "
          f"[{lo:+.3f}, {hi:+.3f}] ({len(diff)} prompts); {args.b} ahead on {int((diff > 0).sum())}, "
          f"behind on {int((diff < 0).sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
