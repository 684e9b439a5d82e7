"""``dspark train --compile``: the training objective through ``torch.compile``.

The *objective* is the trainer's drafter + its kind's teacher-forced training forward + loss, one
call per micro-batch (:class:`dspark.training.trainer._Objective`). Compiled, its forward becomes
inductor graphs and its backward, through AOT autograd, their generated backward: the element-wise
work on the [rows, γ, V_d] logits (log-softmax, the L1 to the teacher, the cross-entropy, their
gradients) fuses into a few loops instead of one pass over memory per op.

The graphs are dynamic in every size from the first call (``dynamic=True``): micro-batches differ
in padded length, and torch's default — a size turns symbolic at its second value — would compile
twice; with it no batch shape compiles again. Two pieces of every kind's forward run eagerly,
between the graphs: the teacher distribution (:func:`~dspark.training.forward.teacher_at`, whose
shapes depend on the data) and the construction of :class:`~dspark.training.forward.Targets`
(dynamo cannot build a frozen attrs instance).

Compiling happens at the first call. That call is a trial (:meth:`CompiledObjective.trial`): the
forward and the backward of the first micro-batch, run outside data parallelism so a failure leaves
nothing half-done, its gradients then discarded. A compiler that is missing
(:func:`~dspark.fast.compile.check_compiler`) or a trial that fails turns the objective eager, said
in one logged sentence; training goes on either way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["CompiledObjective"]

log = logging.getLogger(__name__)


class CompiledObjective(torch.nn.Module):
    """``objective`` (a module taking one batch) called through ``torch.compile``, or eagerly once
    compiling proved impossible. ``eager`` says which, ``why_eager`` why (None: compiled)."""

    def __init__(self, objective: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        super().__init__()
        from dspark.fast.compile import CompileUnavailable, check_compiler

        self.objective = objective
        self.why_eager: str | None = None
        self.tried = False
        self._compiled: Any = None
        try:
            check_compiler(torch.device(device))
            # the bound forward, not the module: a compiled module would register as a second
            # child holding the same parameters
            self._compiled = torch.compile(objective.forward, dynamic=True)
        except CompileUnavailable as err:
            self._give_up(str(err))

    @property
    def eager(self) -> bool:
        return self._compiled is None

    def forward(self, batch: Any) -> Any:
        return self.objective(batch) if self._compiled is None else self._compiled(batch)

    def trial(self, batch: Any, params: list[torch.nn.Parameter]) -> None:
        """Compile by running the forward and the backward of ``batch`` once; on any failure turn
        eager. Either way the trial's gradients are dropped (``params``' ``.grad`` set to None):
        call it right after the optimizer's ``zero_grad(set_to_none=True)``."""
        self.tried = True
        if self._compiled is None:
            return
        try:
            self._compiled(batch)[0].backward()
        except Exception as err:  # inductor's failures share no base class
            from dspark.fast.compile import first_line

            self._give_up(f"torch.compile failed on the training objective's first batch ({first_line(err)})")
        for p in params:
            p.grad = None

    def _give_up(self, why: str) -> None:
        self._compiled, self.why_eager = None, why
        log.warning("%s; training runs eager", why)
