"""How much a verification step's time depends on what ran just before it: the same step back to
back (plain decoding), right after a large step (a profile's random sweep), right after the same R
with another width, and after a 10 ms pause.

    python scripts/step_order.py --out RUNS/step_order --dtype bfloat16 --step compiled

The target (SmolLM2-135M) holds 64 requests of ``--context`` tokens; each (R, 1 + ℓ) of
``--requests`` × ``--widths`` is timed as the median of 12 calls back to back (after 3), and of
8 calls each right after the ``--after`` step (R = 64, 8 tokens by default), after the same R with
another width, and after a sleep. Caches are rolled back after every call, as ``dspark profile``
does. Writes ``step_order.json`` and ``step_order.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("step_order")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--step", choices=("eager", "packed", "compiled"), default="compiled")
    p.add_argument("--context", type=int, default=87)
    p.add_argument("--requests", default="1,2,4,8,16")
    p.add_argument("--widths", default="1,4")
    p.add_argument("--after", default="64,8", help="R,width of the step timed before each 'after' sample")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    requests = [int(r) for r in args.requests.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    big = tuple(int(v) for v in args.after.split(","))
    if min(requests + widths + list(big)) < 1 or len(big) != 2:
        p.error("--requests, --widths and --after take positive integers (--after: R,width)")
    args.out.mkdir(parents=True, exist_ok=True)

    from dspark.profiling import device_name, timed_step
    from dspark.targets import load_target

    target = load_target("smollm2-135m", getattr(torch, args.dtype), device="cpu", path=args.step)
    g = torch.Generator().manual_seed(0)
    top = max(requests + [big[0]])
    ids = [f"order-{i}" for i in range(top)]
    for rid in ids:
        target.prefill([rid], [torch.randint(target.vocab_size, (args.context + 1,), generator=g)])
    keep = torch.full((top,), args.context)

    def call(R: int, width: int) -> float:
        return timed_step(target, ids[:R], keep[:R], width, g)

    shapes = [(R, w) for R in requests for w in widths]
    other = {w: next((v for v in (8, 1, 4, 2) if v != w), w) for w in widths}
    for R, w in shapes + [big] + [(R, other[w]) for R, w in shapes]:  # compile and warm every graph
        call(R, w), call(R, w)
    rows = []
    for R, w in shapes:
        back = [call(R, w) for _ in range(15)][3:]
        after_big, after_other, after_pause = [], [], []
        for _ in range(8):
            call(*big)
            after_big.append(call(R, w))
            call(R, other[w])
            after_other.append(call(R, w))
            time.sleep(0.01)
            after_pause.append(call(R, w))
        row = {"requests": R, "width": w, "back_to_back": statistics.median(back),
               "after_large": statistics.median(after_big), "after_other_width": statistics.median(after_other),
               "after_pause": statistics.median(after_pause)}
        rows.append(row)
        log.info("R=%d q=%d: back to back %.1f ms, after R=%d q=%d %.1f ms, after q=%d %.1f ms, after 10 ms %.1f ms",
                 R, w, row["back_to_back"] * 1e3, *big, row["after_large"] * 1e3, other[w],
                 row["after_other_width"] * 1e3, row["after_pause"] * 1e3)
    meta = {"device": device_name(target), "dtype": args.dtype, "step": target.path, "context": args.context,
            "after": list(big), "threads": torch.get_num_threads(), "torch": torch.__version__}
    (args.out / "step_order.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# A step's time by what ran before it: {meta['device']}, {args.dtype}, {target.path} step, "
             f"{args.context}-token context, {meta['threads']} threads, torch {meta['torch']}", "",
             f"`python scripts/step_order.py --out OUT --dtype {args.dtype} --step {args.step}` (medians, ms)", "",
             f"| R | 1 + ℓ | back to back | after R = {big[0]}, {big[1]} tokens | after the same R, another width "
             "| after a 10 ms pause | after the large step / back to back |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['requests']} | {r['width']} | {r['back_to_back'] * 1e3:.1f} | {r['after_large'] * 1e3:.1f} | "
              f"{r['after_other_width'] * 1e3:.1f} | {r['after_pause'] * 1e3:.1f} | "
              f"{r['after_large'] / r['back_to_back']:.2f} |" for r in rows]
    (args.out / "step_order.md").write_text("\n".join(lines) + "\n")
    log.info("wrote %s and step_order.md", args.out / "step_order.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
