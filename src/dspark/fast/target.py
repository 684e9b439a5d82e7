""":class:`FastTarget`: :class:`~dspark.hf_target.HFTarget`'s requests and caches, stepped by
:class:`~dspark.fast.llama.LlamaStep` instead of the HF forward.

The request bookkeeping (per-request KV tensors, rollback, release, capture ids) is HFTarget's;
only the batched forward differs:

* the past is read in place (R = 1: a view of the request's own KV tensor) or gathered
  left-aligned into the reused scratch buffer (R > 1) with a validity mask [R, T] instead of
  HF's left padding, and the new tokens' K/V come back from the step to be stored;
* linear weights are prepacked for the CPU's matmul library (``pack``), or the step runs through
  ``torch.compile`` (``compiled``: inductor with weight freezing on a CPU, CUDA graphs on a GPU),
  with the past length T rounded up to a multiple of ``bucket`` so a GPU records few CUDA graphs.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

import dspark.fast.compile as compiling
from dspark.fast.compile import AUTOTUNE_OPTIONS, FEW_ROWS_OPTIONS, CompileUnavailable, first_line
from dspark.fast.llama import LlamaStep, supports
from dspark.hf_batch_cache import RequestKV, zero_padded
from dspark.hf_target import HFTarget
from dspark.options import STEP_PATHS

__all__ = ["FastTarget", "PATHS", "build_target"]

log = logging.getLogger(__name__)

PATHS = STEP_PATHS  # eager = HFTarget's own HF forward

# model → {path: (step, callable)}: every target around one model shares its packed weights and
# its compiled graphs (the demo and the bench build several engines on one model).
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_step(model: Any, path: str, device: torch.device) -> tuple[LlamaStep, Any]:
    per_model = _STEPS.setdefault(model, {})
    if path not in per_model:
        step = LlamaStep(model, pack=path == "packed")
        run = step
        if path == "compiled":
            from dspark.fast.compile import compile_step

            run = compile_step(step, device, graph_options=_graph_options)
        per_model[path] = (step, run)
    return per_model[path]


def _graph_options(tokens: torch.Tensor, position_ids: torch.Tensor, past: torch.Tensor,
                   *rest: Any) -> dict[str, Any] | None:
    """The inductor settings of the graph a step on ``tokens`` [R, q] compiles beyond the CPU's
    own (:func:`~dspark.fast.compile.compile_step`): in bf16 one request's one token (plain
    decoding) and its 2 … :func:`~dspark.fast.compile.few_rows` tokens (a short verification, the
    class :func:`_mark_rows` bounds) run their products on the GEMM template, untimed
    (:func:`_template_rows`); in fp32 one request's one token autotunes them; the rest run on
    oneDNN."""
    if _template_rows(tokens, past.dtype):
        return FEW_ROWS_OPTIONS
    R, q = tokens.shape
    return AUTOTUNE_OPTIONS if R == 1 and q == 1 else None  # not bf16: the template's lowering has no fallback


def _template_rows(tokens: torch.Tensor, dtype: torch.dtype) -> bool:
    """One request's 1 … :func:`~dspark.fast.compile.few_rows` tokens [R, q] of a bf16 step: the
    rows whose products run on the GEMM template (:func:`_graph_options`) in graphs of their own
    (:func:`_mark_rows`)."""
    R, q = tokens.shape
    return R == 1 and compiling.template_rows(q, dtype)


def _mark_rows(tokens: torch.Tensor, most: int, dtype: torch.dtype) -> None:
    """Bound the token count of one request's several-token graph to its class
    (:func:`~dspark.fast.compile.row_class`; oneDNN's up to ``most``, the context limit), so that
    each set of kernels compiles one graph."""
    R, q = tokens.shape
    if R == 1 and q > 1:
        lo, hi = compiling.row_class(q, dtype, most)
        torch._dynamo.mark_dynamic(tokens, 1, min=lo, max=hi)


def build_target(model: Any, tokenizer: Any = None, capture_layers: Iterable[int] = (), *,
                 path: str = "packed") -> HFTarget:
    """A target for ``model`` on ``path`` (:data:`PATHS`), falling back with one logged sentence:
    ``compiled`` → ``packed`` where ``torch.compile`` cannot run here, and ``packed`` / ``compiled``
    → ``eager`` (the HF forward) for a model the fast step does not cover. ``target.path`` says
    which path runs."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path != "eager":
        try:
            return FastTarget(model, tokenizer, capture_layers, path=path)
        except CompileUnavailable as err:
            log.warning("%s; running the packed eager step instead", err)
            return build_target(model, tokenizer, capture_layers, path="packed")
        except NotImplementedError as err:
            log.warning("%s; running the HF forward (eager) instead", err)
    return HFTarget(model, tokenizer, capture_layers)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class FastTarget(HFTarget):
    """An :class:`HFTarget` whose forward is :class:`LlamaStep` (module docstring).

    ``path``: ``"packed"`` (eager, prepacked weights) or ``"compiled"`` (``torch.compile``).
    Raises NotImplementedError with one sentence for a model the step does not cover.
    """

    def __init__(self, model: Any, tokenizer: Any = None, capture_layers: Iterable[int] = (), *,
                 path: str = "packed", bucket: int = 64) -> None:
        if path not in ("packed", "compiled"):
            raise ValueError(f"path must be 'packed' or 'compiled', got {path!r}")
        reason = supports(model)
        if reason is not None:
            raise NotImplementedError(reason)
        super().__init__(model, tokenizer, capture_layers)
        self.path = path
        self.bucket = bucket if path == "compiled" else 1
        self._step, self._run = _shared_step(model, path, self._device)

    def _new_store(self, capacity: int) -> RequestKV:
        store = super()._new_store(_round_up(capacity, self.bucket))
        store.kv.zero_()  # never-written slots are masked, but 0 · NaN in attn @ V is still NaN
        return store

    def _forward(
        self, reqs: list[RequestKV], tokens: torch.Tensor, q_lens: torch.Tensor, want_logits: bool = True
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        R, q = tokens.shape
        dev = self._device
        past_len = torch.tensor([req.length for req in reqs], dtype=torch.long)  # [R]
        T = _round_up(int(past_len.max()), self.bucket)
        compiled = self._run is not self._step
        if R == 1:
            req = reqs[0]
            # compiled: room beyond the T read, so the view's strides never equal those of a
            # contiguous [.., T, d] tensor — else the first graph assumes they do and the first
            # request that grows its cache compiles another one (a stall of seconds, mid-decode)
            req.reserve(max(T + (self.bucket if compiled else 0), req.length + q), self.max_context)
            past = req.kv[:, :, :, :T].unsqueeze(2)  # [L, 2, 1, H_kv, T, d], read in place
        else:
            shape = (self.num_layers, 2, R, self._kv_heads, T, self._head_dim)
            past = self._scratch_view(shape)  # [L, 2, R, H_kv, T, d]
            for r, req in enumerate(reqs):
                past[:, :, r, :, : req.length].copy_(req.kv[:, :, :, : req.length])
                past[:, :, r, :, req.length :].zero_()
        valid = (torch.arange(T)[None, :] < past_len[:, None]).to(dev)  # [R, T]
        position_ids = (past_len[:, None] + torch.arange(q)[None, :]).to(dev)  # [R, q]
        capture = tuple(self.capture_layers)
        run, asked = self._run, capture
        if T == 0:  # a prefill: long prompts once per request, not worth a compiled graph per shape
            run = self._step
        elif run is not self._step:
            # one graph for every capture set used on this model (an engine switches capture off in
            # the rounds its draft gate skips; a plain engine beside a drafting one captures
            # nothing): the union, each extra layer's state a few stores instead of another compile
            step = self._step
            step.graph_capture = tuple(sorted(set(step.graph_capture) | set(capture)))
            asked = step.graph_capture
        graphed = run is not self._step and dev.type == "cuda"
        if graphed:  # a CUDA graph's outputs live in its static buffers, overwritten by the next replay
            torch.compiler.cudagraph_mark_step_begin()
        # the compiled graph reads the capture set from the step module (a constant to torch.compile)
        # a fresh [R, q] tensor: a slice of a wider one keeps its strides, and a compiled graph
        # guards on them (a [1, 1] slice of a [1, 8] block would compile its own graph)
        tokens = torch.empty((R, q), dtype=tokens.dtype, device=dev).copy_(tokens)
        if run is not self._step and dev.type == "cpu":
            _mark_rows(tokens, self.max_context, past.dtype)
        args = (tokens, position_ids, past, valid, None if run is not self._step else asked, want_logits)
        try:
            logits, captured, new_kv = run(*args)
        except Exception as err:  # a compile that fails on this model: the packed step instead
            if run is self._step:
                raise
            log.warning("the compiled target step failed (%s); running the packed step instead", first_line(err))
            self.path = "packed"
            self._step, self._run = _shared_step(self.model, "packed", dev)
            graphed, run = False, self._run
            logits, captured, new_kv = run(*args[:4], asked, want_logits)
        captured = [captured[asked.index(k)] for k in capture]
        if graphed:
            logits = logits.clone() if logits is not None else None
            captured = [h.clone() for h in captured]
        for r, (req, n) in enumerate(zip(reqs, q_lens.tolist())):  # new_kv [L, 2, R, H_kv, q, d]
            req.reserve(req.length + n, self.max_context)
            req.kv[:, :, :, req.length : req.length + n].copy_(new_kv[:, :, r, :, :n])
            req.length += n
        if not want_logits:
            logits = torch.zeros(R, 0, self.vocab_size, dtype=self._kv_dtype, device=dev)
        return zero_padded(logits, dict(zip(capture, captured)), q_lens, want_logits)  # hidden {k: [R, q, D]}
