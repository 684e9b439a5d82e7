"""Record a checkpoint's measured vocabulary cut (``vocab_cut.json`` beside its weights) from a
``dspark eval`` of the drafter and one ``:vocab=K`` variant at temperature 0.

    dspark eval --drafter CKPT --drafter CKPT:vocab=K --temperature 0 --out RUNS/eval-cut
    python scripts/record_vocab_cut.py CKPT RUNS/eval-cut/eval.json

``dspark demo`` then races the cut against the full drafter where its τ is within 1 %
(:mod:`dspark.drafters.vocab_cut`). A bad eval is refused in one sentence (exit code 2).
"""

from __future__ import annotations

import argparse
import sys

from dspark.checkpoints import resolve_checkpoint
from dspark.drafters.vocab_cut import raceable_cut, record_vocab_cut


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a shipped drafter's name or a checkpoint folder")
    p.add_argument("eval_json", help="the eval.json of dspark eval over the drafter and its :vocab=K variant")
    args = p.parse_args()
    try:
        folder = resolve_checkpoint(args.checkpoint)
        path = record_vocab_cut(folder, args.eval_json)
    except (ValueError, FileNotFoundError) as err:
        print(f"record_vocab_cut: {err}", file=sys.stderr)
        return 2
    cut, why = raceable_cut(folder)
    print(f"wrote {path}: " + (f"{cut.reference} keeps {cut.tau_ratio:.1%} of τ; dspark demo races it" if cut
                               else f"not raced: {why}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
