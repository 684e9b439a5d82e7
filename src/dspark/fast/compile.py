"""``torch.compile`` for :class:`~dspark.fast.llama.LlamaStep`, with a one-sentence failure.

* CPU: inductor with weight freezing — parameters become constants, so the linear weights are
  prepacked for oneDNN / MKL once (AMX or AVX-512 tiles for bf16) and the element-wise ops between
  them fuse into a few C++ loops;
* GPU: ``mode="reduce-overhead"`` — each shape's kernels are captured once as a CUDA graph and
  replayed, removing the per-kernel launch cost that bounds a small model's eager step.

Compiled graphs land in inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default under
the system temporary folder), so a second start-up with the same model, dtype and shapes reuses
them. Compilation happens at the first call of each new shape; :func:`compile_step` makes the first call
itself, so that a missing compiler or an unsupported op is found at once and reported as
:class:`CompileUnavailable` instead of in the middle of a request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

__all__ = ["CompileUnavailable", "compile_step"]

log = logging.getLogger(__name__)


class CompileUnavailable(RuntimeError):
    """``torch.compile`` cannot run here (no C++ compiler, an unsupported op, ...)."""


def compile_step(step: torch.nn.Module, device: torch.device, example: tuple, *,
                 dynamic: bool | None = None) -> Any:
    """``step`` compiled for ``device``, already called once on ``example`` (its arguments).

    On a CPU the graphs are dynamic in every size from the start (``dynamic=True``): torch
    specialises only sizes 0 and 1, so a handful of graphs (one row or many, one token or many)
    cover every shape. Raises :class:`CompileUnavailable` with the first line of the error."""
    if device.type == "cuda":
        fn = torch.compile(step, mode="reduce-overhead", dynamic=False if dynamic is None else dynamic)
    else:
        fn = _Frozen(torch.compile(step, dynamic=True if dynamic is None else dynamic))
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            fn(*example)
    except Exception as err:  # inductor's failures have no common base class
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompileUnavailable(f"torch.compile failed on {device.type} ({type(err).__name__}: {first[:200]})") from err
    log.info("compiled the target step in %.1f s", time.perf_counter() - t0)
    return fn


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
