"""Measuring a target's verification step time → the ``sps-table`` cost-model profile.

``dspark profile`` times :meth:`HFTarget.verify` for R requests × (1 + ℓ) tokens each over
``contexts`` tokens of KV cache, the shapes the engine runs (padded batches: B = R · (1 + ℓ)).
Every shape is timed ``repeats`` times after one warm-up, in sweeps over all shapes in a random
order (so drift does not bias the shapes measured last), rolling the caches back after every step;
the median is kept. At each context the shapes are split into t(R, B) = bias + α(R) + θ(B)
(:func:`additive_cost_fit`): at the *main* context (the first of ``contexts``) the profile's
points are bias + θ(B) and its ``batch_overhead`` α(R); every other context is a curve with its
own α(R) (the KV cache read per request grows with the context), or, where its shapes cannot be
split, the main α(R) subtracted. Every (context, R, 1 + ℓ) median is kept in the shapes file so
a user can see how much longer contexts cost.

A shape timed after a random other one is how a drafted round's verification runs (after the
drafter's forward), not how plain decoding runs (the same one-token step again and again, which
on a CPU can run faster: its working set still in the caches, presumably; measured by
``scripts/step_order.py``). So the same sweeps also time, for each R, a run of
one-token steps back to back (:func:`time_profile`): the profile's ``plain_steps``, against which
the draft gate compares drafting.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.cost_models import SPSProfile

__all__ = ["ProfileFitError", "additive_cost_fit", "cpu_name", "time_shapes", "profile_from_shapes",
           "time_profile", "timed_step", "save_shapes", "load_shapes", "read_bandwidth", "step_weight_bytes", "traffic_floor",
           "distinct_bytes", "bytes_floor"]


class ProfileFitError(ValueError):
    """The measured shapes cannot be split into α(R) + θ(M)."""


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


def read_bandwidth(device: Any = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second one pass over a ``nbytes`` buffer reads (the best of ``repeats``; a sum,
    so each byte is read once and nothing is written): the memory bandwidth a step's weights are
    streamed at, with torch's threads."""
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each counted once however often it is listed (a tied weight, a view
    listed twice: the same storage, offset and size)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def step_weight_bytes(model: Any) -> int:
    """Bytes of weights one decoder step reads: every parameter once, except an input embedding
    that is not also the LM head (a step reads only its rows)."""
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and embed is not None and head.weight.data_ptr() == embed.data_ptr()
    return distinct_bytes(p for p in model.parameters() if tied or p is not embed)


def traffic_floor(model: Any, bandwidth: float | None = None) -> dict[str, float]:
    """The memory-traffic floor of one step: weight bytes ÷ read bandwidth (measured unless given).
    No decode step of one token can be faster on this machine unless it reads fewer bytes."""
    device = next(model.parameters()).device
    return bytes_floor(step_weight_bytes(model), read_bandwidth(device) if bandwidth is None else bandwidth)


def bytes_floor(nbytes: int, bandwidth: float) -> dict[str, float]:
    """The floor of reading ``nbytes`` at ``bandwidth`` bytes a second, as the reports record it."""
    return {"weight_bytes": nbytes, "bandwidth_bytes_per_second": bandwidth, "floor_seconds": nbytes / bandwidth}


def synchronize(target: Any) -> None:
    """Wait for the target's device (CUDA launches are asynchronous: a step is timed when it is done)."""
    dev = getattr(target, "_device", None)
    if getattr(dev, "type", "cpu") == "cuda":
        torch.cuda.synchronize(dev)


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
    return time_profile(target, requests, widths, contexts, repeats, seed, progress, plain_run=0)[0]


def time_profile(
    target: Any,
    requests: Sequence[int],
    widths: Sequence[int],
    contexts: Sequence[int],
    repeats: int = 5,
    seed: int = 0,
    progress: bool = True,
    plain_run: int = 3,
) -> tuple[dict[tuple[int, int, int], float], dict[tuple[int, int], float]]:
    """Median seconds of ``target.verify`` per (context, R, 1 + ℓ), each shape timed right after a
    random other one (as a drafted round's verification runs, after the drafter), and per
    (context, R) the plain step as plain decoding runs it: the last of ``plain_run`` one-token
    steps in a row (none when 0). Both are timed in the same sweeps, so a drift of the machine's
    speed lands on both alike."""
    from tqdm import tqdm

    for what, vals in (("requests", requests), ("widths", widths), ("contexts", contexts)):
        if not vals or any(not isinstance(v, int) or v < 1 for v in vals):
            raise ValueError(f"{what} must be positive integers, got {list(vals)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if plain_run < 0:
        raise ValueError(f"plain_run must be >= 0, got {plain_run}")
    top = max(contexts) + max(widths) + 1
    if top > target.max_context:
        raise ValueError(f"context {max(contexts)} + {max(widths)} verified tokens exceeds the target's "
                         f"context window ({target.max_context})")
    g = torch.Generator().manual_seed(seed)
    order = random.Random(seed)
    times: dict[tuple[int, int, int], float] = {}
    plain: dict[tuple[int, int], float] = {}
    # (R, 1 + ℓ) a shape after another; (R, 0) a run of plain steps of R requests
    shapes = [(R, w) for R in requests for w in widths] + ([(R, 0) for R in requests] if plain_run else [])
    with tqdm(total=len(contexts) * len(shapes) * (1 + repeats), desc="profiling verification",
              disable=not progress) as bar:
        for ctx in contexts:
            ids = [f"profile-{ctx}-{i}" for i in range(max(requests))]
            for rid in ids:  # context + 1 prompt tokens: the cache holds `ctx`, the last one is the anchor
                target.prefill([rid], [torch.randint(target.vocab_size, (ctx + 1,), generator=g)])
            keep = torch.full((len(ids),), ctx)
            samples: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
            try:
                # Sweeps over every shape in a fresh random order, the first a warm-up: a drift of
                # the machine's speed (other load, clocks) spreads over all shapes instead of
                # landing on the ones measured last.
                for sweep in range(1 + repeats):
                    for R, width in order.sample(shapes, len(shapes)):
                        if width:
                            elapsed = timed_step(target, ids[:R], keep[:R], width, g)
                        else:
                            elapsed = [timed_step(target, ids[:R], keep[:R], 1, g) for _ in range(plain_run)][-1]
                        if sweep:
                            samples[R, width].append(elapsed)
                        bar.update(1)
            finally:
                for rid in ids:
                    target.release(rid)
            for (R, width), xs in samples.items():
                if width:
                    times[ctx, R, width] = statistics.median(xs)
                else:
                    plain[ctx, R] = statistics.median(xs)
    return times, plain


def timed_step(target: Any, ids: Sequence[str], keep: torch.Tensor, width: int, g: torch.Generator) -> float:
    """Seconds of one ``target.verify`` of ``width`` random tokens for each request of ``ids``,
    whose caches are rolled back to ``keep`` [R] tokens after it."""
    tokens = torch.randint(target.vocab_size, (len(ids), width), generator=g)
    synchronize(target)
    t0 = time.perf_counter()
    target.verify(ids, tokens, torch.full((len(ids),), width - 1))
    synchronize(target)
    elapsed = time.perf_counter() - t0
    target.rollback(ids, keep)
    return elapsed


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


def additive_cost_fit(shapes: Mapping[tuple[int, int], float]) -> tuple[float, dict[int, float], dict[int, float]]:
    """Measured whole-step seconds per (R, 1 + ℓ) → (bias, α(R), θ(M)) in seconds, M = R · (1 + ℓ).

    Least squares of T = a_R + θ_M over one-hot unknowns; the gauge (a + c, θ − c) is fixed by
    shifting θ so the line through its two smallest M extrapolates to 0 at M = 0; bias = min a_R,
    α(R) = a_R − bias. Needs shapes that connect the R values through shared M (e.g. (1, 2) and
    (2, 1)); otherwise each component would get its own offset.
    """
    cells = sorted(shapes.items())
    Rs = sorted({r for (r, _), _ in cells})
    Ms = sorted({r * w for (r, w), _ in cells})
    if len(Ms) < 2:
        raise ProfileFitError("the cost table needs shapes at two or more token counts M")
    _check_connected([(r, r * w) for (r, w), _ in cells])
    A = np.zeros((len(cells), len(Rs) + len(Ms)))
    y = np.array([s for _, s in cells])
    for i, ((r, w), _) in enumerate(cells):
        A[i, Rs.index(r)] = 1.0
        A[i, len(Rs) + Ms.index(r * w)] = 1.0
    x = np.linalg.lstsq(A, y, rcond=None)[0]
    a, theta = x[: len(Rs)], x[len(Rs):]
    slope = (theta[1] - theta[0]) / (Ms[1] - Ms[0])
    c = theta[0] - slope * Ms[0]  # θ's intercept at M = 0
    a, theta = a + c, theta - c
    bias = float(a.min())
    return bias, {r: float(v - bias) for r, v in zip(Rs, a)}, {m: float(v) for m, v in zip(Ms, theta)}


def _check_connected(edges: Sequence[tuple[int, int]]) -> None:
    parent: dict[Any, Any] = {}

    def find(u: Any) -> Any:
        while parent.setdefault(u, u) != u:
            u = parent[u]
        return u

    for r, m in edges:
        parent[find(("R", r))] = find(("M", m))
    roots = {find(("R", r)) for r, _ in edges}
    if len(roots) > 1:
        raise ProfileFitError("the measured shapes do not connect every batch size through a shared token "
                          "count M = R·(1+ℓ); profile widths that make them meet (e.g. --widths 1,2,4,8 with "
                          "--requests 1,2,4,8)")


def profile_from_shapes(
    times: dict[tuple[int, int, int], float], *, model: str, dtype: str, device: str, repeats: int,
    source: str = "dspark profile", plain: Mapping[tuple[int, int], float] | None = None,
) -> SPSProfile:
    """The ``sps-table`` profile of the main (first-timed) context, B = R · (1 + ℓ) padded.

    The shapes are split into the additive model t(R, B) = bias + α(R) + θ(B)
    (:func:`additive_cost_fit`): points are bias + θ(B), ``batch_overhead`` α(R) — one request
    verifying 8 tokens and 8 requests verifying one each share B = 8 but not their cost. When the
    shapes cannot be split (one R, or R values not linked through a shared B), each B keeps the
    largest median among the shapes that share it and no overhead is recorded. Every other
    context is split the same way into a curve and its own α(R) (``contexts``). ``plain``
    ((context, R) → seconds, :func:`time_profile`) becomes the profile's ``plain_steps``.
    """
    main_ctx = next(iter(times))[0]
    main = {(R, w): s for (ctx, R, w), s in times.items() if ctx == main_ctx}
    overhead: list[tuple[int, float]] = []
    try:
        points, overhead = _split(main)
        how = "split additively: points = bias + theta(B), batch_overhead = alpha(R)"
    except ProfileFitError:
        by_b: dict[int, float] = {}
        for (R, width), seconds in main.items():
            by_b[R * width] = max(by_b.get(R * width, 0.0), seconds)
        points = sorted(by_b.items())
        how = "where shapes share B the largest median is kept"
    threads = torch.get_num_threads()
    contexts = sorted({c for c, _, _ in times})
    others = []
    for c in (c for c in contexts if c != main_ctx):
        shapes = {(R, w): s for (ctx, R, w), s in times.items() if ctx == c}
        try:  # its own α(R): the KV cache read per request grows with the context
            others.append((c, *_split(shapes)) if overhead else (c, _curve_at(shapes, overhead), ()))
        except ProfileFitError:
            others.append((c, _curve_at(shapes, overhead), ()))
    return SPSProfile(
        device=device, model=model, dtype=dtype, date=time.strftime("%Y-%m-%d"), accounting="padded",
        points=points, threads=threads, batch_overhead=overhead, context=main_ctx, contexts=others,
        plain_steps=sorted((c, R, s) for (c, R), s in (plain or {}).items()),
        notes=(f"{source}: HFTarget.verify, R x (1 + l) tokens over a {main_ctx}-token context (curves at the "
               f"other contexts timed: {contexts}), median of {repeats} after one warm-up, torch {torch.__version__}, "
               f"{threads} threads. B = R * (1 + l) padded tokens; {how}."
               + (" plain_steps: one-token steps of R requests, the last of a run back to back." if plain else "")),
    )


def _split(shapes: Mapping[tuple[int, int], float]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """One context's shapes → (points bias + θ(B), α(R)) by :func:`additive_cost_fit`."""
    bias, alpha, theta = additive_cost_fit(shapes)
    return [(M, max(bias + t, 1e-6)) for M, t in theta.items()], sorted(alpha.items())


def _curve_at(shapes: Mapping[tuple[int, int], float], overhead: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points of another context's curve when its shapes cannot be split on their own (too few
    widths timed there): each shape's median minus the main context's α(R)
    (the profile records one α), averaged over the shapes that share B = R · (1 + ℓ); without an
    α, the largest median per B (as the main curve's fallback)."""
    by_b: dict[int, list[float]] = {}
    for (R, width), seconds in shapes.items():
        a = float(np.interp(R, [r for r, _ in overhead], [v for _, v in overhead])) if overhead else 0.0
        by_b.setdefault(R * width, []).append(seconds - a)
    pick = (lambda v: sum(v) / len(v)) if overhead else max
    return [(B, max(pick(v), 1e-6)) for B, v in sorted(by_b.items())]
