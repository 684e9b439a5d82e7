"""Start-up choices made by measurement on the machine at hand: the target's dtype, the path its
step runs on, and its cost profile.

Whether bf16 pays on a CPU depends on the CPU: with native bf16 instructions (AVX-512-BF16, AMX)
a bf16 product is cheaper than an fp32 one and verifying several tokens costs little more than one;
without them bf16 matmuls are emulated and the step grows about linearly with the tokens verified. How the step runs
matters as much: the HF forward (``eager``) hands oneDNN unpacked bf16 weights, which it re-lays-out
on every call; :mod:`dspark.fast` offers the same arithmetic with prepacked weights (``packed``) and
compiled by inductor (``compiled``). None of this is assumed: :func:`choose_dtype` times the
verification profile t(1 + ℓ), ℓ = 0..γ, of one request over ``context`` tokens of KV cache for
each candidate dtype × path, keeps the fastest, and returns its profile — the cost model the
scheduler and the draft gate then use. Compiling is slow (inductor's on-disk cache shortens later
start-ups), so it is raced only in the dtype that won the eager paths.

The fastest plain step is not always the fastest speculative decode: a configuration whose step
grows little with the tokens verified can win with drafting while losing at one token. Given a
:class:`Speculation` — the drafter's acceptance survival and a way to time its round overhead on a
candidate target — every candidate is rated by its best fixed draft length's expected tokens per
second at one request (:func:`dspark.cost_models.best_fixed_length`, k = 0 being plain decoding),
and the speculative engine runs in the best one; plain decoding is still timed in each and
``plain_label`` names the fastest, for the baseline a fair comparison needs.

Terms: a *plain step* is one target forward of one new token (plain decoding's cost per token);
``context`` is the KV-cache length the job will decode at (prompt + about half the new tokens).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from attrs import frozen

from dspark.cost_models import SPSTableCostModel
from dspark.cost_models.accounting import best_fixed_length, check_survival
from dspark.profiling import cpu_name, time_shapes

__all__ = ["Machine", "DtypeChoice", "Speculation", "DTYPES", "measure_profile", "choose_dtype",
           "profile_cost_model", "full_block_survival"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU flags that decide whether bf16 (and wide fp32) matmuls are native here.
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# Environment variables that cap the ISA oneDNN / ATen use (they emulate an older CPU).
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


@frozen
class Machine:
    """The CPU a figure was measured on: model, the ISA flags that matter, threads, ATen's kernels."""

    cpu: str
    cores: int
    flags: tuple[str, ...]  # the subset of _ISA_FLAGS the CPU reports
    threads: int  # torch intra-op threads
    capability: str  # the vector ISA ATen dispatches to ("AVX512", "AVX2", ...)
    caps: tuple[str, ...]  # "NAME=value" for every ISA cap set in the environment

    @classmethod
    def current(cls) -> Machine:
        flags: set[str] = set()
        try:
            for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except AttributeError:  # very old torch
            capability = "unknown"
        return cls(cpu_name(), os.cpu_count() or 1, tuple(f for f in _ISA_FLAGS if f in flags),
                   torch.get_num_threads(), capability,
                   tuple(f"{k}={os.environ[k]}" for k in _ISA_CAPS if os.environ.get(k)))

    @property
    def native_bf16(self) -> bool:
        """The CPU has bf16 dot-product instructions and no ISA cap hides them."""
        return bool({"avx512_bf16", "amx_bf16"} & set(self.flags)) and not self.caps

    @property
    def kind(self) -> str:
        """The kind of CPU for the per-machine figures: with or without native bf16."""
        if self.native_bf16:
            return "AVX-512-BF16" if "avx512_bf16" in self.flags else "AMX-BF16"
        wide = "AVX-512" if "avx512f" in self.flags and not self.caps else "AVX2"
        return f"{wide} only (bf16 emulated)" + (" — " + ", ".join(self.caps) if self.caps else "")

    def describe(self) -> str:
        return (f"{self.cores}-core {self.cpu}, {self.kind}; flags {' '.join(self.flags) or 'none'}; "
                f"ATen {self.capability}; {self.threads} threads")

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "cores": self.cores, "flags": list(self.flags), "threads": self.threads,
                "aten_capability": self.capability, "isa_caps": list(self.caps), "kind": self.kind,
                "native_bf16": self.native_bf16}


def measure_profile(target: Any, context: int, widths: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """Median seconds of one request verifying w tokens over ``context`` tokens of cache, per w."""
    times = time_shapes(target, [1], list(widths), [context], repeats=repeats, progress=False)
    return {w: s for (_, _, w), s in sorted(times.items(), key=lambda kv: kv[0][2])}


def profile_cost_model(points: dict[int, float], *, dtype: str, model: str, device: str) -> SPSTableCostModel:
    """The ``sps-table`` cost model of measured points t(q), q = tokens verified by one request.

    One can always pad q up to a cheaper larger shape, so the cost of q tokens is the minimum over
    shapes ≥ q: a non-decreasing envelope that keeps timing noise out of the schedule.
    """
    env = dict(points)
    sizes = sorted(env)
    for i in range(len(sizes) - 2, -1, -1):
        env[sizes[i]] = min(env[sizes[i]], env[sizes[i + 1]])
    return SPSTableCostModel.from_points(env, accounting="packed", model=model, dtype=dtype, device=device,
                                         date=time.strftime("%Y-%m-%d"), threads=torch.get_num_threads())


def label(dtype: str, path: str) -> str:
    """A raced configuration's name: ``"bfloat16/packed"``."""
    return f"{dtype}/{path}"


@frozen
class DtypeChoice:
    """What :func:`choose_dtype` measured and picked: a dtype and the path its step runs on
    (:data:`dspark.fast.PATHS`); every dict is keyed by configuration :func:`label`."""

    dtype: str
    context: int
    plain_step_seconds: dict[str, float]  # configuration → one plain step at ``context``
    profile: dict[int, float]  # the chosen configuration's t(q), q = 1..γ+1
    fixed: bool  # the user fixed the dtype (only its profile was measured)
    seconds: float  # how long the measurement took, compilation included
    machine: Machine
    # with a Speculation: configuration → {"draft_length": k*, "tokens_per_second": its expected
    # rate at one request, "plain_tokens_per_second": 1 / t(1), "overhead_seconds": a drafted
    # round's overhead}
    speculative: dict[str, dict[str, float]] = attrs.field(factory=dict)
    path: str = "eager"
    compile_seconds: float | None = None  # racing the compiled step, its compiles included
    notes: tuple[str, ...] = ()  # one sentence per candidate left out (a fallback, a failed compile)

    @property
    def label(self) -> str:
        return label(self.dtype, self.path)

    @property
    def plain_label(self) -> str:
        """The configuration of the fastest plain step (the plain-decoding baseline's)."""
        return min(self.plain_step_seconds, key=self.plain_step_seconds.__getitem__)

    @property
    def plain_dtype(self) -> str:
        return self.plain_label.split("/")[0]

    @property
    def plain_path(self) -> str:
        return self.plain_label.split("/")[1]

    @property
    def reason(self) -> str:
        """One line: what was picked and why."""
        ms = ", ".join(f"{d} {s * 1e3:.1f} ms" for d, s in self.plain_step_seconds.items())
        if self.fixed:
            how = "dtype fixed by the user"
        elif len(self.speculative) > 1:
            rated = ", ".join(f"{d} {v['tokens_per_second']:.1f} tok/s at k = {int(v['draft_length'])}"
                              for d, v in self.speculative.items())
            how = (f"the faster speculative decode, expected at one request: {rated}; "
                   f"plain decoding is fastest in {self.plain_label}")
        else:
            how = "the fastest plain step"
        built = (f"; the compiled step took {self.compile_seconds:.0f} s of it, compiling included"
                 if self.compile_seconds is not None else "")
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"target step {self.label} ({how}; plain step at a {self.context}-token context: {ms}; "
                f"measured in {self.seconds:.1f} s{built} on {self.machine.cores}-core {self.machine.cpu}, "
                f"{self.machine.kind}{notes})")

    def cost_model(self, model: str = "target") -> SPSTableCostModel:
        m = self.machine
        return profile_cost_model(self.profile, dtype=self.dtype, model=model,
                                  device=f"{m.cores}-core {m.cpu} ({m.kind}, {m.threads} threads, {self.path})")

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "path": self.path, "context": self.context, "fixed_by_user": self.fixed,
                "plain_step_seconds": self.plain_step_seconds, "plain": self.plain_label,
                "speculative": self.speculative, "compile_seconds": self.compile_seconds,
                "profile_step_seconds": {str(q): s for q, s in self.profile.items()},
                "measure_seconds": self.seconds, "notes": list(self.notes), "reason": self.reason,
                "machine": self.machine.to_dict()}


@frozen
class Speculation:
    """What drafting is worth, for the dtype race (module docstring): ``survival`` s_j =
    P(accepted ≥ j), j = 1..γ, measured with every draft position verified (acceptance hardly
    depends on the dtype), and ``overhead(target, cost_model)`` → seconds a drafted round of one
    request spends beyond its verification step on that candidate target (drafting, bookkeeping:
    :func:`dspark.bench.prior.measure_draft_overhead`)."""

    survival: tuple[float, ...] = attrs.field(converter=lambda v: tuple(check_survival(v)))
    overhead: Callable[[Any, Any], float] = attrs.field(validator=attrs.validators.is_callable())


def full_block_survival(accepted: Sequence[int], proposed: Sequence[int], gamma: int) -> tuple[float, ...]:
    """s_j = P(accepted ≥ j), j = 1..γ, over the rounds that verified a full block of γ drafts.

    :func:`dspark.interop.survival_from_rounds` counts every round of a recorded eval; here a round
    cut short (the last ones of an answer) is left out, as it could not accept past its proposal."""
    full = [a for a, p in zip(accepted, proposed) if p == gamma]
    if not full:
        raise ValueError(f"no round verified a full block of {gamma} drafts: the survival is unknown")
    return tuple(sum(a >= j for a in full) / len(full) for j in range(1, gamma + 1))


def choose_dtype(
    model: Any,
    tokenizer: Any,
    *,
    context: int,
    gamma: int,
    dtype: str = "auto",
    candidates: Sequence[str] = ("float32", "bfloat16"),
    paths: Sequence[str] | None = None,
    repeats: int = 5,
    make_target: Any = None,
    speculation: Speculation | None = None,
) -> tuple[DtypeChoice, Any]:
    """Pick the target's dtype and step path by measurement (module docstring) → (choice, target).

    ``model`` is an HF causal LM in any dtype; the other candidates are cast copies of it.
    ``dtype="auto"`` races every dtype in ``candidates``; a dtype name fixes it. Each dtype is
    timed on every path of ``paths`` (default: eager and packed, and compiled on a GPU) but
    ``"compiled"``; compiling costs minutes, so only the
    winner's dtype is then compiled and timed (:mod:`dspark.fast`). ``make_target(model,
    tokenizer, path)`` wraps a model (default :func:`dspark.fast.build_target`; a path it falls
    back from is left out of the race, with its sentence in ``choice.notes``).
    ``speculation``: each configuration is rated by its expected speculative tokens per second
    at one request (``choice.speculative``), and the race is on that instead of the plain step;
    ``choice.plain_label`` still names the fastest plain one.
    """
    if make_target is None:
        from dspark.fast import build_target as make_target
    from dspark.fast import PATHS
    from dspark.options import race_paths

    if paths is None:  # every path, the compiled one only on a GPU (minutes of compiling on a CPU)
        paths = race_paths("auto", None, next(model.parameters()).device.type)

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be a non-negative integer, got {gamma!r}")
    names = [dtype] if dtype != "auto" else list(candidates)
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype candidates {unknown}; choose from {sorted(DTYPES)}")
    bad = [p for p in paths if p not in PATHS] or ([] if paths else ["(none)"])
    if bad:
        raise ValueError(f"unknown step paths {bad}; choose from {', '.join(PATHS)}")
    if speculation is not None and len(speculation.survival) > gamma:
        raise ValueError(f"the survival has {len(speculation.survival)} positions, more than gamma = {gamma}")
    window = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(window, int) and context + gamma + 2 > window:
        context = max(window - gamma - 2, 1)  # a prompt near the window: time the longest context that fits
    t0 = time.perf_counter()
    own = next(model.parameters()).dtype
    models = {n: model if DTYPES[n] == own else copy.deepcopy(model).to(DTYPES[n]) for n in names}
    steps: dict[str, float] = {}
    profiles: dict[str, dict[int, float]] = {}
    targets: dict[str, Any] = {}
    rated: dict[str, dict[str, float]] = {}
    notes: list[str] = []

    def race(name: str, path: str) -> None:
        target = make_target(models[name], tokenizer, path=path)
        got = getattr(target, "path", path)
        if got != path:
            notes.append(f"{label(name, path)} fell back to {got}")
            return
        key = label(name, path)
        targets[key] = target
        # the whole profile t(1..γ+1): measuring it costs ~γ more steps, far less than a second build
        profiles[key] = measure_profile(target, context, range(1, gamma + 2), repeats)
        steps[key] = profiles[key][1]
        if speculation is not None:
            cost = profile_cost_model(profiles[key], dtype=name, model="target", device="cpu")
            extra = float(speculation.overhead(target, cost))
            k, rate = best_fixed_length(speculation.survival, cost, 1, draft_seconds=extra)
            rated[key] = {"draft_length": k, "tokens_per_second": rate,
                          "plain_tokens_per_second": 1.0 / profiles[key][1], "overhead_seconds": extra}

    def best() -> str:
        if speculation is not None:
            return max(rated, key=lambda n: rated[n]["tokens_per_second"])
        return min(steps, key=steps.__getitem__)

    for name in names:
        for path in paths:
            if path != "compiled":
                race(name, path)
    compile_seconds = None
    if "compiled" in paths:
        t1 = time.perf_counter()  # graphs compile at their first calls: time the whole candidate
        race(best().split("/")[0] if targets else names[0], "compiled")
        compile_seconds = time.perf_counter() - t1
    if not targets:
        raise RuntimeError("no step path could run here: " + "; ".join(notes))
    chosen = best()
    choice = DtypeChoice(chosen.split("/")[0], context, steps, profiles[chosen], dtype != "auto",
                         time.perf_counter() - t0, Machine.current(), rated, chosen.split("/")[1],
                         compile_seconds, tuple(notes))
    return choice, targets[chosen]
