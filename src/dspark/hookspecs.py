"""The dspark plugin hooks: one ``register_*`` hook per extension point.

A plugin is any module or object with functions decorated ``@dspark.hookimpl`` and named after
these hooks. Each hook receives a ``register`` callback::

    @dspark.hookimpl
    def register_schedulers(register):
        register("my-scheduler", MyScheduler, description="...")

``register(name, factory, description="")``: ``factory(**config)`` must return an object that
satisfies the extension point's protocol (a class is checked when registered, every instance when
built). Built-ins are registered through these same hooks (:mod:`dspark.builtins`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pluggy

hookspec = pluggy.HookspecMarker("dspark")
hookimpl = pluggy.HookimplMarker("dspark")


class Register(Protocol):
    def __call__(self, name: str, factory: Callable[..., Any], description: str = "") -> None: ...


@hookspec
def register_drafters(register: Register) -> None:
    """Register Drafter factories (:class:`dspark.protocols.Drafter`)."""


@hookspec
def register_drafter_kinds(register: Register) -> None:
    """Register DrafterKind factories (:class:`dspark.protocols.DrafterKind`): a zero-argument
    callable returning the kind object (config rules, module, graphs, training recipe)."""


@hookspec
def register_sequential_heads(register: Register) -> None:
    """Register SequentialHead factories (:class:`dspark.protocols.SequentialHead`)."""


@hookspec
def register_confidence_models(register: Register) -> None:
    """Register ConfidenceModel factories (:class:`dspark.protocols.ConfidenceModel`)."""


@hookspec
def register_calibrators(register: Register) -> None:
    """Register Calibrator factories (:class:`dspark.protocols.Calibrator`)."""


@hookspec
def register_cost_models(register: Register) -> None:
    """Register CostModel factories (:class:`dspark.protocols.CostModel`)."""


@hookspec
def register_schedulers(register: Register) -> None:
    """Register Scheduler factories (:class:`dspark.protocols.Scheduler`)."""
