"""Verification step time of the SmolLM2 target vs batch shape → an ``sps-table`` profile.

    python scripts/bench_target.py --out out/profile_smollm2_cpu.json

Kept for the figures in docs/serving-and-benchmarks.md; it is ``dspark profile`` with that page's shapes
(R ∈ {1, 2, 4, 8, 16} × (1 + ℓ) ∈ {1, 2, 4, 8}, one 128-token context).
"""

from __future__ import annotations

import argparse
import sys

from dspark.cli import main as dspark_main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/profile_smollm2_cpu.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    argv = ["profile", "--out", a.out, "--repeats", str(a.repeats), "--contexts", str(a.context),
            "--dtype", a.dtype, "--seed", str(a.seed), "--requests", "1,2,4,8,16", "--widths", "1,2,4,8"]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    sys.exit(dspark_main(argv))


if __name__ == "__main__":
    main()
