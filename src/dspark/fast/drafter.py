"""The draft round on its fastest runner, chosen by measurement.

A PyTorch drafter runs its graphs (:mod:`dspark.drafters.graphs`) either as the modules are
(``eager``: products on prepacked weights where they pack) or through ``torch.compile``
(``compiled``: inductor with weight freezing on a CPU — the small element-wise ops between the
products, which dominate a block of a few tokens, fuse into a few loops — CUDA graphs on a GPU).
Which is faster depends on the machine and the drafter, so :func:`choose_draft_runner` times the
round overhead of each (:func:`dspark.bench.prior.measure_draft_overhead`: a drafted round
beyond a plain one, on the cost model's clock) and keeps the faster, saying so in one line.
A compiler that is missing, or a graph that fails to compile, leaves the drafter eager with one
sentence saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

__all__ = ["DraftRunnerChoice", "choose_draft_runner", "use_draft_runner"]

log = logging.getLogger(__name__)

DRAFT_RUNNERS = ("eager", "compiled")


@attrs.frozen
class DraftRunnerChoice:
    """What the race measured: the round overhead per runner (seconds beyond a plain round at one
    request), the winner, the compile time, and why a candidate was left out."""

    runner: str
    overhead_seconds: dict[str, float]
    compile_seconds: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """One line for the start-up log."""
        timed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.overhead_seconds.items())
        built = f"; compiling took {self.compile_seconds:.0f} s" if self.compile_seconds is not None else ""
        left = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"draft round on the {self.runner} runner: {timed} beyond a plain round at one request{built}{left}"

    def to_dict(self) -> dict[str, Any]:
        return {"runner": self.runner, "overhead_seconds": dict(self.overhead_seconds),
                "compile_seconds": self.compile_seconds, "notes": list(self.notes)}


def use_draft_runner(drafter: Any, runner: str) -> str:
    """Run ``drafter``'s graphs on ``runner`` (:data:`DRAFT_RUNNERS`) from its next round on and
    return the runner it got: a drafter that is not a PyTorch graph drafter (n-gram, ONNX) keeps
    its own, and ``compiled`` falls back to ``eager`` in one logged sentence where
    ``torch.compile`` cannot run here."""
    from dspark.drafters.loop import TorchRunner
    from dspark.fast.compile import CompileUnavailable, check_compiler

    if runner not in DRAFT_RUNNERS:
        raise ValueError(f"draft runner must be one of {', '.join(DRAFT_RUNNERS)}, got {runner!r}")
    loop = getattr(drafter, "loop", None)
    if loop is None or not isinstance(loop.runner, TorchRunner):
        return "own"
    if runner == "compiled":
        try:
            check_compiler(loop.device)
        except CompileUnavailable as err:
            log.warning("%s; the drafter runs eager", err)
            runner = "eager"
    if loop.runner.path != runner:
        loop.use_runner(TorchRunner(drafter, compiled=runner == "compiled"))
    return runner


def choose_draft_runner(target: Any, drafter: Any, ids: Sequence[torch.Tensor], cost_model: Any,
                        calibrator: Any = None, runners: Sequence[str] = DRAFT_RUNNERS,
                        rounds: int = 8) -> DraftRunnerChoice:
    """Time the drafter's round overhead on each of ``runners`` (one request, prompts ``ids``),
    leave the drafter on the fastest and return what was measured. A compiled candidate is warmed
    up (its graphs compiled, timed as ``compile_seconds``) before it is timed."""
    from dspark.bench.prior import measure_draft_overhead

    measured: dict[str, float] = {}
    notes: list[str] = []
    compile_seconds = None
    for runner in runners:
        got = use_draft_runner(drafter, runner)
        if got != runner:
            notes.append(f"{runner}: not available here, ran {got}")
            continue
        if runner == "compiled":
            t0 = time.perf_counter()
            # the graphs compile at their first calls: a pass of the timing itself meets every shape class
            measure_draft_overhead(target, drafter, ids, [1], cost_model, calibrator, rounds=rounds, passes=1)
            compile_seconds = time.perf_counter() - t0
            if drafter.loop.runner.path != "compiled":  # a graph failed to compile: the runner went eager (logged)
                notes.append("compiled: a graph failed to compile, the drafter ran eager")
                continue
        measured[runner] = measure_draft_overhead(target, drafter, ids, [1], cost_model, calibrator,
                                                  rounds=rounds).get(1, 0.0)
    best = min(measured, key=measured.__getitem__) if measured else "eager"
    use_draft_runner(drafter, best)
    choice = DraftRunnerChoice(best, measured, compile_seconds, tuple(notes))
    log.info(choice.reason)
    return choice
