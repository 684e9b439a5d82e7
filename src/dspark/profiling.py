"""Measuring a target's verification step time → the ``sps-table`` cost-model profile.

``dspark profile`` times :meth:`HFTarget.verify` for R requests × (1 + ℓ) tokens each over
``contexts`` tokens of KV cache, the shapes the engine runs (padded batches: B = R · (1 + ℓ)).
Every shape is timed ``repeats`` times after one warm-up, rolling the caches back after every step;
the median is kept. The profile's points are, per B, the largest median among the shapes that
share B at the *main* context (the first of ``contexts``); every (context, R, 1 + ℓ) median is
kept in ``shapes`` so a user can see how much longer contexts cost.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.cost_models import SPSProfile

__all__ = ["cpu_name", "time_shapes", "profile_from_shapes", "save_shapes", "load_shapes"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(target: Any) -> str:
    dev = getattr(target, "_device", torch.device("cpu"))
    if getattr(dev, "type", "cpu") == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{os.cpu_count()}-core {cpu_name()}"


def time_shapes(
    target: Any,
    requests: Sequence[int],
    widths: Sequence[int],
    contexts: Sequence[int],
    repeats: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> dict[tuple[int, int, int], float]:
    """Median seconds of ``target.verify`` per (context, R, 1 + ℓ)."""
    from tqdm import tqdm

    for what, vals in (("requests", requests), ("widths", widths), ("contexts", contexts)):
        if not vals or any(not isinstance(v, int) or v < 1 for v in vals):
            raise ValueError(f"{what} must be positive integers, got {list(vals)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    top = max(contexts) + max(widths) + 1
    if top > target.max_context:
        raise ValueError(f"context {max(contexts)} + {max(widths)} verified tokens exceeds the target's "
                         f"context window ({target.max_context})")
    g = torch.Generator().manual_seed(seed)
    times: dict[tuple[int, int, int], float] = {}
    with tqdm(total=len(contexts) * len(requests) * len(widths), desc="profiling verification",
              disable=not progress) as bar:
        for ctx in contexts:
            ids = [f"profile-{ctx}-{i}" for i in range(max(requests))]
            for rid in ids:  # context + 1 prompt tokens: the cache holds `ctx`, the last one is the anchor
                target.prefill([rid], [torch.randint(target.vocab_size, (ctx + 1,), generator=g)])
            keep = torch.full((len(ids),), ctx)
            try:
                for R in requests:
                    for width in widths:
                        tokens = torch.randint(target.vocab_size, (R, width), generator=g)
                        lengths = torch.full((R,), width - 1)
                        samples = []
                        for step in range(1 + repeats):  # the first one warms up
                            t0 = time.perf_counter()
                            target.verify(ids[:R], tokens, lengths)
                            elapsed = time.perf_counter() - t0
                            target.rollback(ids[:R], keep[:R])
                            if step:
                                samples.append(elapsed)
                        times[ctx, R, width] = statistics.median(samples)
                        bar.update(1)
            finally:
                for rid in ids:
                    target.release(rid)
    return times


def save_shapes(times: dict[tuple[int, int, int], float], path: str | Path) -> Path:
    """Every timed (context, R, 1 + ℓ) median as JSON rows (``dspark profile``'s FILE.shapes.json)."""
    import json

    rows = [{"context": c, "requests": r, "tokens_per_request": w, "step_seconds": s} for (c, r, w), s in times.items()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")
    return path


def load_shapes(path: str | Path, context: int | None = None) -> dict[tuple[int, int], float]:
    """{(R, 1 + ℓ): seconds} at ``context`` (default: the first context in the file)."""
    import json

    try:
        rows = json.loads(Path(path).read_text())
        context = rows[0]["context"] if context is None else context
        out = {(int(r["requests"]), int(r["tokens_per_request"])): float(r["step_seconds"])
               for r in rows if r["context"] == context}
    except (KeyError, IndexError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a shapes file written by dspark profile: {err}") from None
    if not out:
        raise ValueError(f"{path} holds no shapes at context {context}")
    return out


def profile_from_shapes(
    times: dict[tuple[int, int, int], float], *, model: str, dtype: str, device: str, repeats: int,
    source: str = "dspark profile",
) -> SPSProfile:
    """The ``sps-table`` profile of the main (first-timed) context; B = R · (1 + ℓ), padded."""
    main_ctx = next(iter(times))[0]
    by_b: dict[int, float] = {}
    for (ctx, R, width), seconds in times.items():
        if ctx == main_ctx:
            by_b[R * width] = max(by_b.get(R * width, 0.0), seconds)
    threads = torch.get_num_threads()
    contexts = sorted({c for c, _, _ in times})
    return SPSProfile(
        device=device, model=model, dtype=dtype, date=time.strftime("%Y-%m-%d"), accounting="padded",
        points=sorted(by_b.items()), threads=threads,
        notes=(f"{source}: HFTarget.verify, R x (1 + l) tokens over a {main_ctx}-token context (other "
               f"contexts timed: {contexts}), median of {repeats} after one warm-up, torch {torch.__version__}, "
               f"{threads} threads. B = R * (1 + l) padded tokens; where shapes share B the largest median is kept."),
    )
