"""The draft round on its fastest runner, chosen by measurement.

A PyTorch drafter runs its graphs (:mod:`dspark.drafters.graphs`) on one of :data:`DRAFT_RUNNERS`:

* ``eager`` — the modules as they are (products on prepacked weights where they pack);
* ``compiled`` — through ``torch.compile`` (inductor with weight freezing on a CPU: the small
  element-wise ops between the products, which dominate a block of a few tokens, fuse into a few
  loops; CUDA graphs on a GPU);
* ``onnxruntime`` — the graphs exported to ONNX in a temporary folder and run by ONNX Runtime
  sessions (:mod:`dspark.export.live`: a bound fp32 drafter on the CPU; the user exports nothing).

Which is fastest depends on the machine and the drafter, so :func:`choose_draft_runner` times the
round overhead of each candidate (:func:`dspark.bench.prior.measure_draft_overhead`: a drafted
round beyond a plain one, on the cost model's clock) after a warm-up pass of that same measure,
keeps the fastest and says so in one line. A candidate that cannot run here (no compiler, a bf16
drafter for ONNX Runtime, a graph that does not export) is skipped with one sentence saying why;
one whose graph fails during its warm-up has fallen back to eager and is not timed under its name.

:func:`fastest_drafter` is what every command that serves a checkpoint runs where the target's step
is compiled (``dspark demo``, ``serve``, ``bench``): the runner race, and the race of the folder's
measured vocabulary cut against the full drafter (:mod:`dspark.drafters.vocab_cut`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from dspark.drafters.loop import GraphRunner

__all__ = ["DRAFT_RUNNERS", "DraftRunnerChoice", "DrafterSetup", "RunnerUnavailable", "build_draft_runner",
           "choose_draft_runner", "fastest_drafter", "use_draft_runner"]

log = logging.getLogger(__name__)

DRAFT_RUNNERS = ("eager", "compiled", "onnxruntime")


class RunnerUnavailable(RuntimeError):
    """A draft runner cannot run this drafter here; the message says why in one sentence."""


@attrs.frozen
class DraftRunnerChoice:
    """What the race measured: the round overhead per runner (seconds beyond a plain round at one
    request), the winner, the compile and export times, and why a candidate was left out."""

    runner: str
    overhead_seconds: dict[str, float]
    compile_seconds: float | None = None
    notes: tuple[str, ...] = ()
    export_seconds: float | None = None  # exporting the graphs and loading them into onnxruntime

    @property
    def reason(self) -> str:
        """One line for the start-up log."""
        timed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.overhead_seconds.items())
        timed = f"{timed} beyond a plain round at one request" if timed else "nothing timed"
        built = f"; compiling took {self.compile_seconds:.0f} s" if self.compile_seconds is not None else ""
        if self.export_seconds is not None:
            built += f"; exporting to onnxruntime took {self.export_seconds:.1f} s"
        left = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"draft round on the {self.runner} runner: {timed}{built}{left}"

    def to_dict(self) -> dict[str, Any]:
        return {"runner": self.runner, "overhead_seconds": dict(self.overhead_seconds),
                "compile_seconds": self.compile_seconds, "export_seconds": self.export_seconds,
                "notes": list(self.notes)}


def _check_names(runners: Iterable[str]) -> None:
    for runner in runners:
        if runner not in DRAFT_RUNNERS:
            raise ValueError(f"draft runner must be one of {', '.join(DRAFT_RUNNERS)}, got {runner!r}")


def runs_own_graphs(drafter: Any) -> bool:
    """Whether ``drafter`` drafts through a runner of its own graphs (a PyTorch graph drafter),
    which these functions may switch; an n-gram or an exported drafter runs its own way."""
    loop = getattr(drafter, "loop", None)
    return loop is not None and getattr(loop.runner, "drafter", None) is drafter


def build_draft_runner(drafter: Any, runner: str) -> GraphRunner:
    """A new ``runner`` (:data:`DRAFT_RUNNERS`) for ``drafter``'s graphs, not yet in use; raises
    :class:`RunnerUnavailable` where it cannot run here. An ``onnxruntime`` runner is exported
    and loaded here; a ``compiled`` one compiles its graphs at their first calls."""
    from dspark.drafters.loop import TorchRunner

    _check_names([runner])
    if runner == "eager":
        return TorchRunner(drafter)
    if runner == "compiled":
        from dspark.fast.compile import CompileUnavailable, check_compiler

        try:
            check_compiler(next(drafter.parameters()).device)
        except CompileUnavailable as err:
            raise RunnerUnavailable(str(err)) from None
        return TorchRunner(drafter, compiled=True)
    from dspark.export.live import OrtUnavailable, live_ort_runner

    try:
        return live_ort_runner(drafter, threads=torch.get_num_threads())
    except OrtUnavailable as err:
        raise RunnerUnavailable(f"onnxruntime cannot run this drafter here ({err})") from None


def use_draft_runner(drafter: Any, runner: str) -> str:
    """Run ``drafter``'s graphs on ``runner`` (:data:`DRAFT_RUNNERS`) from its next round on and
    return the runner it got: a drafter that is not a PyTorch graph drafter (n-gram, ONNX) keeps
    its own (``own``), and a runner that cannot run here falls back to ``eager`` in one logged
    sentence."""
    _check_names([runner])
    if not runs_own_graphs(drafter):
        return "own"
    loop = drafter.loop
    if loop.runner.path == runner:
        return runner
    try:
        new = build_draft_runner(drafter, runner)
    except RunnerUnavailable as err:
        log.warning("%s; the drafter runs eager", err)
        runner = "eager"
        if loop.runner.path == runner:
            return runner
        new = build_draft_runner(drafter, runner)
    loop.use_runner(new)
    return runner


def choose_draft_runner(target: Any, drafter: Any, ids: Sequence[torch.Tensor], cost_model: Any,
                        calibrator: Any = None, candidates: Sequence[str] = DRAFT_RUNNERS,
                        rounds: int = 8) -> DraftRunnerChoice:
    """Time the drafter's round overhead on each of ``candidates`` (one request, prompts ``ids``),
    leave the drafter on the fastest — the very runner that was timed, so nothing compiles or
    exports again — and return what was measured.

    Every candidate gets a warm-up pass of the measure first (a compiled runner compiles its graphs
    there, timed as ``compile_seconds``; an ``onnxruntime`` runner's export and session start-up
    are ``export_seconds``). A candidate that cannot run here is skipped with one logged sentence."""
    from dspark.bench.prior import measure_draft_overhead

    _check_names(candidates)
    if not runs_own_graphs(drafter):
        choice = DraftRunnerChoice("own", {}, notes=(f"{type(drafter).__name__} drafts its own way",))
        log.info(choice.reason)
        return choice

    def overhead(**passes: int) -> float:
        return measure_draft_overhead(target, drafter, ids, [1], cost_model, calibrator, rounds=rounds,
                                      **passes).get(1, 0.0)

    loop = drafter.loop
    measured: dict[str, float] = {}
    timed: dict[str, GraphRunner] = {}
    notes: list[str] = []
    compile_seconds = export_seconds = None
    for name in dict.fromkeys(candidates):
        t0 = time.perf_counter()
        try:
            runner = loop.runner if loop.runner.path == name else build_draft_runner(drafter, name)
        except RunnerUnavailable as err:
            log.info("the %s draft runner is skipped: %s", name, err)
            notes.append(f"{name} skipped: {err}")
            continue
        if name == "onnxruntime":
            export_seconds = time.perf_counter() - t0
        loop.use_runner(runner)
        t0 = time.perf_counter()
        overhead(passes=1)  # warm-up: a compiled runner meets every shape class of the timing here
        if name == "compiled":
            compile_seconds = time.perf_counter() - t0
        if runner.path != name:  # a graph failed in the warm-up: the runner went eager (logged)
            failed = "to compile" if name == "compiled" else f"in {name}"
            notes.append(f"{name}: a graph failed {failed}, the drafter ran eager")
            continue
        measured[name] = overhead()
        timed[name] = runner
    best = min(measured, key=measured.__getitem__) if measured else "eager"
    if best in timed:
        loop.use_runner(timed[best])
    else:
        use_draft_runner(drafter, best)
    choice = DraftRunnerChoice(best, measured, compile_seconds, tuple(notes), export_seconds)
    log.info(choice.reason)
    return choice


@attrs.frozen
class DrafterSetup:
    """A checkpoint's drafter as :func:`fastest_drafter` set it up: the drafter (on its runner),
    the ``:vocab=K`` it drafts with (None: the full vocabulary), the calibrator of its confidence
    logits (None where its confidence model calibrates itself), the runner race, and what the
    vocabulary-cut race decided (None where none was run)."""

    drafter: Any
    draft_vocab: int | None
    calibrator: Any
    runner: DraftRunnerChoice
    vocab_race: dict[str, Any] | None = None

    @property
    def overhead_seconds(self) -> float:
        """The measured round overhead on the chosen runner (seconds beyond a plain round, R = 1)."""
        return self.runner.overhead_seconds.get(self.runner.runner, 0.0)


def fastest_drafter(folder: Any, target: Any, ids: Sequence[torch.Tensor], cost_model: Any,
                    verify_seconds: float, draft_vocab: int | None = None, race_cut: bool = True) -> DrafterSetup:
    """Checkpoint ``folder``'s drafter for ``target`` as it drafts fastest here, timed on prompts
    ``ids`` at one request: its graphs on the fastest runner (:func:`choose_draft_runner`), and —
    with ``race_cut``, no ``draft_vocab`` asked for, and a measured cut recorded beside the weights
    (:func:`~dspark.drafters.vocab_cut.raceable_cut`) — the cut, on its own fastest runner, where
    :func:`~dspark.drafters.vocab_cut.cut_pays` says it drafts more tokens a second beside a
    verification step of ``verify_seconds``. The decision is logged in one line."""
    from dspark.drafters.checkpoint import from_pretrained
    from dspark.drafters.vocab_cut import cut_pays, raceable_cut
    from dspark.evaluation.drafter_specs import folder_calibrator

    def setup(vocab: int | None) -> DrafterSetup:
        drafter = from_pretrained(folder, target, draft_vocab=vocab)
        calibrator = folder_calibrator(folder, vocab)
        return DrafterSetup(drafter, vocab, calibrator, choose_draft_runner(target, drafter, ids, cost_model, calibrator))

    full = setup(draft_vocab)
    if draft_vocab is not None or not race_cut:
        return full
    name = Path(folder).name
    cut, why_not = raceable_cut(folder)
    if cut is None:
        reason = f"vocabulary cut not raced: {why_not}"
        log.info("%s", reason)
        return attrs.evolve(full, vocab_race={"raced": False, "reason": reason})
    variant = setup(cut.draft_vocab)
    cut_overhead = variant.runner.overhead_seconds.get(variant.runner.runner, float("inf"))  # untimed: never wins
    wins = cut_pays(cut, verify_seconds, full.overhead_seconds, cut_overhead)
    pick = f"{name}{cut.reference}" if wins else name
    reason = (f"vocabulary cut raced: {name}{cut.reference} (τ {cut.tau_cut:.3f} vs {cut.tau_full:.3f} in its "
              f"record) drafts a round {cut_overhead * 1e3:.1f} ms beyond a plain one on the "
              f"{variant.runner.runner} runner, the full drafter {full.overhead_seconds * 1e3:.1f} ms, beside a "
              f"{verify_seconds * 1e3:.1f} ms verification: {pick} drafts more tokens a second")
    log.info("%s", reason)
    record = {"raced": True, "draft_vocab": cut.draft_vocab, "tau_full": cut.tau_full, "tau_cut": cut.tau_cut,
              "overhead_full": full.overhead_seconds, "overhead_cut": cut_overhead,
              "verify_seconds": verify_seconds, "cut_runner": variant.runner.to_dict(), "chosen": pick,
              "reason": reason}
    return attrs.evolve(variant if wins else full, vocab_race=record)
