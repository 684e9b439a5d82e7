"""Compile a serving engine's graphs before its first request.

A compiled target step (:class:`~dspark.fast.FastTarget`, ``path="compiled"``) compiles one graph
per shape class at the class's first call: one request or several × one token, a few or more (a
plain round, a short or a long verification) × the layers captured for the drafter; a compiled
draft runner does the same for its graphs. Each compile takes seconds to minutes, so the first
request to meet a class — in a server, the first time two requests overlap — stalls for that long.
:func:`warm_up` runs the classes once at start-up instead: short greedy generations at each batch
size, drafting every round at the drafter's full length and at a short one (the verification
classes and the drafter's graphs, on prompts of one, two and many tokens: the drafter's context
calls of each row class) and then plainly (the one-token classes), on the serving
engine's own target and drafter, and says how long it took and how many graphs it compiled. The
per-request state it creates is released when the generations finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

__all__ = ["WarmUp", "warm_up"]

log = logging.getLogger(__name__)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@attrs.frozen
class WarmUp:
    """What :func:`warm_up` ran: the batch sizes, its seconds and the graphs compiled meanwhile."""

    batch_sizes: tuple[int, ...]
    seconds: float
    graphs: int

    @property
    def reason(self) -> str:
        """One line for the start-up log."""
        sizes = ", ".join(str(b) for b in self.batch_sizes)
        return (f"warm-up: {self.graphs} graphs compiled in {self.seconds:.0f} s "
                f"(greedy rounds at {sizes} requests, drafted and plain)")


def warm_up(target: Any, drafter: Any, prompt: torch.Tensor, batch_sizes: Sequence[int] = (1, 2),
            cost_model: Any = None) -> WarmUp:
    """Run each shape class of ``target`` and ``drafter`` (None: plain decoding only) once (module
    docstring) with ``prompt`` (token ids [n]) repeated ``batch_sizes`` times; returns what it took.
    Two batch sizes cover every class of a CPU's compiled step (sizes above one share a graph)."""
    from dspark import get_scheduler
    from dspark.engine import Engine
    from dspark.types import SamplingParams

    sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes))
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch_sizes must be positive request counts, got {list(batch_sizes)}")
    from dspark.fast.compile import few_rows

    engines = []
    if drafter is not None:  # first: its rounds capture the drafter's layers, the union's graph
        # a long verification and a short one (at most few_rows() tokens: in bf16 a graph of its own)
        for k in dict.fromkeys((drafter.gamma, min(drafter.gamma, few_rows() - 1))):
            engines.append(Engine(target, drafter, scheduler=get_scheduler("fixed", k=k),
                                  cost_model=cost_model, calibrator="identity"))
    engines.append(Engine(target, None, cost_model=cost_model))
    gamma = drafter.gamma if drafter is not None else 1
    # the drafter ingests a prompt's positions in one context call: prompts of one, two and more
    # than few_rows() tokens meet each of its row classes (dspark.fast.compile.GraphRows)
    long = prompt.repeat(-(-(few_rows() + 2) // max(prompt.numel(), 1)))
    t0, before = time.perf_counter(), _graphs_compiled()
    for engine in engines:
        for R in sizes:
            for ids in [prompt[:1], prompt[:2], long] if engine.drafter is not None else [prompt]:
                engine.generate([ids] * R, SamplingParams.greedy(), max_new_tokens=2 * gamma + 2, progress=False)
    done = WarmUp(sizes, time.perf_counter() - t0, _graphs_compiled() - before)
    log.info("%s", done.reason)
    return done
