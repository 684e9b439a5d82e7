"""Start-up choices made by measurement on the machine at hand: the target's dtype and its cost profile.

Whether bf16 pays on a CPU depends on the CPU: with AVX-512-BF16 (or AMX) a bf16 step is about half
an fp32 one and verifying 8 tokens costs little more than 1; with AVX2 only, bf16 matmuls are
emulated and the step time grows about linearly with the tokens verified — drafting then cannot pay
in bf16, and fp32 may be the faster plain decode. Neither is assumed: :func:`choose_dtype` times one
plain step (one request, one token over ``context`` tokens of KV cache) of the target in each
candidate dtype, keeps the faster, and returns the verification profile t(1 + ℓ), ℓ = 0..γ, it
measured for that dtype — the cost model the scheduler and the draft gate then use. A few seconds.

The faster plain step is not always the faster speculative decode. On a 2-core Xeon with AMX
(measured 2026-12-02) a bf16 plain step is *slower* than an fp32 one (41 vs 38 ms: a one-row bf16
GEMV gains nothing there) while verifying 8 tokens costs 1.8× one token in fp32 and little more
than one in bf16 (AMX tiles fill with 8 rows). Given a :class:`Speculation` — the drafter's
acceptance survival and a way to time its round overhead on a candidate target — every candidate
is rated by its best fixed draft length's expected tokens per second at one request
(:func:`dspark.cost_models.best_fixed_length`, k = 0 being plain decoding), and the speculative
engine runs in the best one; plain decoding is still timed in each and ``plain_dtype`` names the
faster, for the baseline a fair comparison needs.

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


@frozen
class DtypeChoice:
    """What :func:`choose_dtype` measured and picked."""

    dtype: str
    context: int
    plain_step_seconds: dict[str, float]  # dtype → one plain step at ``context``
    profile: dict[int, float]  # the chosen dtype's t(q), q = 1..γ+1
    fixed: bool  # the user fixed the dtype (only its profile was measured)
    seconds: float  # how long the measurement took
    machine: Machine
    # with a Speculation: dtype → {"draft_length": k*, "tokens_per_second": its expected rate at one
    # request, "plain_tokens_per_second": 1 / t(1), "overhead_seconds": a drafted round's overhead}
    speculative: dict[str, dict[str, float]] = attrs.field(factory=dict)

    @property
    def plain_dtype(self) -> str:
        """The dtype of the faster plain step (the plain-decoding baseline's)."""
        return min(self.plain_step_seconds, key=self.plain_step_seconds.__getitem__)

    @property
    def reason(self) -> str:
        """One line: what was picked and why."""
        ms = ", ".join(f"{d} {s * 1e3:.1f} ms" for d, s in self.plain_step_seconds.items())
        if self.fixed:
            how = "fixed by the user"
        elif len(self.speculative) > 1:
            rated = ", ".join(f"{d} {v['tokens_per_second']:.1f} tok/s at k = {int(v['draft_length'])}"
                              for d, v in self.speculative.items())
            how = (f"the faster speculative decode, expected at one request: {rated}; "
                   f"plain decoding is faster in {self.plain_dtype}")
        else:
            how = "the faster plain step"
        return (f"dtype {self.dtype} ({how}; plain step at a {self.context}-token context: {ms}; "
                f"measured in {self.seconds:.1f} s on {self.machine.cores}-core {self.machine.cpu}, "
                f"{self.machine.kind})")

    def cost_model(self, model: str = "target") -> SPSTableCostModel:
        m = self.machine
        return profile_cost_model(self.profile, dtype=self.dtype, model=model,
                                  device=f"{m.cores}-core {m.cpu} ({m.kind}, {m.threads} threads)")

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "context": self.context, "fixed_by_user": self.fixed,
                "plain_step_seconds": self.plain_step_seconds, "plain_dtype": self.plain_dtype,
                "speculative": self.speculative,
                "profile_step_seconds": {str(q): s for q, s in self.profile.items()},
                "measure_seconds": self.seconds, "reason": self.reason, "machine": self.machine.to_dict()}


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
    repeats: int = 5,
    make_target: Any = None,
    speculation: Speculation | None = None,
) -> tuple[DtypeChoice, Any]:
    """Pick the target's dtype by measurement (module docstring) → (choice, target in that dtype).

    ``model`` is an HF causal LM in any dtype; the other candidates are cast copies of it.
    ``dtype="auto"`` measures every candidate; a dtype name fixes it and measures only its profile.
    ``make_target(model, tokenizer)`` wraps a model (default :class:`dspark.targets.HFTarget`).
    ``speculation``: each measured dtype is rated by its expected speculative tokens per second at
    one request (``choice.speculative``), and under "auto" the candidates race on that instead of
    the plain step; ``choice.plain_dtype`` still names the faster plain one.
    """
    if make_target is None:
        from dspark.targets import HFTarget as make_target
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be a non-negative integer, got {gamma!r}")
    names = [dtype] if dtype != "auto" else list(candidates)
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype candidates {unknown}; choose from {sorted(DTYPES)}")
    t0 = time.perf_counter()
    own = next(model.parameters()).dtype
    steps: dict[str, float] = {}
    profiles: dict[str, dict[int, float]] = {}
    targets: dict[str, Any] = {}
    for name in names:
        m = model if DTYPES[name] == own else copy.deepcopy(model).to(DTYPES[name])
        targets[name] = make_target(m, tokenizer)
        # t(1) for the choice; the whole profile only where it may be kept (every candidate under
        # "auto": measuring the rest costs ~γ more steps, far less than a second reload).
        profiles[name] = measure_profile(targets[name], context, range(1, gamma + 2), repeats)
        steps[name] = profiles[name][1]
    best = min(steps, key=steps.__getitem__)
    rated: dict[str, dict[str, float]] = {}
    if speculation is not None:  # every measured dtype rated; a race only under "auto"
        if len(speculation.survival) > gamma:
            raise ValueError(f"the survival has {len(speculation.survival)} positions, more than gamma = {gamma}")
        for name in names:
            cost = profile_cost_model(profiles[name], dtype=name, model="target", device="cpu")
            extra = float(speculation.overhead(targets[name], cost))
            k, rate = best_fixed_length(speculation.survival, cost, 1, draft_seconds=extra)
            rated[name] = {"draft_length": k, "tokens_per_second": rate,
                           "plain_tokens_per_second": 1.0 / profiles[name][1], "overhead_seconds": extra}
        if dtype == "auto":
            best = max(rated, key=lambda n: rated[n]["tokens_per_second"])
    choice = DtypeChoice(best, context, steps, profiles[best], dtype != "auto", time.perf_counter() - t0,
                         Machine.current(), rated)
    return choice, targets[best]
