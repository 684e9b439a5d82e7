"""One scheduler against another in a finished `dspark bench` run, pooled over levels and repeats:
the geometric mean of the per-(level, repeat) throughput ratios with a bootstrap 95 % interval.

    python scripts/bench_pooled.py /work/runs/s11/aa sps-greedy plain --levels 4,8,16,32,64
    python scripts/bench_pooled.py /work/runs/s11/aa plain#2 plain --levels 4,8,16,32,64   # the A/A control

Each pair is two runs of one repeat at one level (interleaved runs share the same minutes), so the
machine's drift cancels; the bootstrap resamples pairs (10,000 resamples, seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.bench.report import pooled_ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the bench's --out folder (holding bench.json)")
    ap.add_argument("a", help="scheduler label, e.g. sps-greedy")
    ap.add_argument("b", help="scheduler label it is divided by, e.g. plain")
    ap.add_argument("--levels", help="concurrency levels to pool, e.g. 4,8,16 (default: all)")
    args = ap.parse_args(argv)
    path = args.out / "bench.json"
    if not path.is_file():
        sys.exit(f"bench_pooled: no bench.json in {args.out}")
    levels = [int(x) for x in args.levels.split(",")] if args.levels else None
    try:
        q = pooled_ratio(json.loads(path.read_text())["runs"], args.a, args.b, levels)
    except ValueError as e:
        sys.exit(f"bench_pooled: {e}")
    print(f"{q['a']} / {q['b']}: {q['pairs']} pairs, geometric mean {q['geomean']:.4f}, "
          f"95 % interval [{q['low']:.4f}, {q['high']:.4f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
