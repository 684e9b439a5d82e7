"""``torch.compile`` for :class:`~dspark.fast.llama.LlamaStep`, with a one-sentence failure.

* CPU: inductor with weight freezing — parameters become constants, so the linear weights are
  prepacked for oneDNN / MKL once (AMX or AVX-512 tiles for bf16) and the element-wise ops between
  them fuse into a few C++ loops;
* GPU: ``mode="reduce-overhead"`` — each shape's kernels are captured once as a CUDA graph and
  replayed, removing the per-kernel launch cost that bounds a small model's eager step.

Compiled graphs land in inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default under
the system temporary folder), so a second start-up with the same model, dtype and shapes reuses
them. Compilation happens at the first call of each new shape class; :func:`check_compiler` finds a
missing compiler in seconds beforehand, and :class:`~dspark.fast.FastTarget` falls back to the
packed step, in one logged sentence, if a model's compile fails later.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CompileUnavailable", "compile_step"]


class CompileUnavailable(RuntimeError):
    """``torch.compile`` cannot run here (no C++ compiler, an unsupported op, ...)."""


_CHECKED: dict[str, str | None] = {}  # device type → None (compiles) or why not


def check_compiler(device: torch.device) -> None:
    """Compile and run a two-op function on ``device`` once per process: a missing C++ compiler
    (CPU) or Triton (GPU) shows here in seconds, as :class:`CompileUnavailable`, instead of
    minutes into a model's compile."""
    key = device.type
    if key not in _CHECKED:
        try:
            fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, dynamic=False)
            fn(torch.ones(8, device=device))
            _CHECKED[key] = None
        except Exception as err:  # inductor's failures have no common base class
            _CHECKED[key] = _sentence(err)
    if _CHECKED[key] is not None:
        raise CompileUnavailable(f"torch.compile cannot run on {key} here ({_CHECKED[key]})")


def _sentence(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")


def compile_step(step: torch.nn.Module, device: torch.device, *, dynamic: bool | None = None) -> Any:
    """``step`` compiled for ``device`` (after :func:`check_compiler`). Graphs are compiled at the
    first call of each new shape class.

    On a CPU the graphs are dynamic in every size from the start (``dynamic=True``): torch
    specialises only sizes 0 and 1, so two graphs (one token or several) cover every verification.
    On a GPU sizes become symbolic at their second value and each concrete size records its own
    CUDA graph."""
    check_compiler(device)
    if device.type == "cuda":
        return torch.compile(step, mode="reduce-overhead", dynamic=dynamic)
    return _Frozen(torch.compile(step, dynamic=True if dynamic is None else dynamic))


class _Frozen:
    """Calls a compiled function with inductor's weight freezing on. Freezing is read when a graph
    is compiled, which happens at the first call of each new shape, so every call sets it
    (``torch.compile(options={"freezing": True})`` does not reach the freezing pass: the weights
    stay graph inputs and every bf16 product re-lays its weight out, as in eager)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(freezing=True):
            return self.fn(*args)
