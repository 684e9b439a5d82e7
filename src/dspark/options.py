"""Shared pieces of the options objects behind the commands.

Each command (``dspark data``, ``train``, ``eval``, ``calibrate``, ``bench``, ``demo``) is a typed
library function taking an attrs ``@frozen`` options object (:class:`dspark.data.build.DataOptions`,
:class:`dspark.training.run.TrainOptions`, ...) whose defaults are the command line's. Validators
check values (ranges, choices, contradicting options) when the object is built, each failure one
sentence in a ``ValueError``; what depends on the world at call time (files on disk, names in the
plugin registry) is checked in the first lines of the function, before any model loads.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs

__all__ = [
    "NamespaceOptions", "at_least", "existing_device", "floats", "ints", "one_of", "optional_ints", "optional_path", "path",
    "resolve_options", "strings", "unit_interval", "STEP_PATHS", "race_paths",
]

T = TypeVar("T")

# How the target step runs (dspark.fast): the HF forward, dspark's step with prepacked weights, or
# that step through torch.compile. "auto" races them at start-up (dspark.autotune.choose_dtype).
STEP_PATHS = ("eager", "packed", "compiled")


def race_paths(step: str, compile: bool | None = None, device: Any = "cpu") -> tuple[str, ...]:
    """The step paths a start-up race times: ``eager`` and ``packed`` for ``"auto"``, and
    ``compiled`` too where ``compile`` says so (None: on a GPU only — on a CPU compiling costs
    minutes at start-up), else the one path given."""
    if step == "auto":
        if compile is None:
            compile = str(device).startswith("cuda")
        return STEP_PATHS if compile else STEP_PATHS[:2]
    if step not in STEP_PATHS:
        raise ValueError(f"step must be auto or one of {', '.join(STEP_PATHS)}, got {step!r}")
    return (step,)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def at_least(low: float, *, integer: bool = True, strict: bool = False) -> Callable[[Any, Any, Any], None]:
    """A validator: a number (an integer unless ``integer=False``) ≥ ``low`` (> when ``strict``)."""

    def check(_inst: Any, a: Any, v: Any) -> None:
        ok = isinstance(v, int) and not isinstance(v, bool) if integer else _number(v)
        if not ok or v < low or (strict and v == low):
            what = "an integer" if integer else "a number"
            raise ValueError(f"{a.name} must be {what} {'>' if strict else '≥'} {low:g}, got {v!r}")

    return check


def unit_interval(*, open_low: bool = False, open_high: bool = False) -> Callable[[Any, Any, Any], None]:
    """A validator: a number in [0, 1] (ends excluded as asked)."""

    def check(_inst: Any, a: Any, v: Any) -> None:
        if not _number(v) or v < 0 or v > 1 or (open_low and v == 0) or (open_high and v == 1):
            span = ("(" if open_low else "[") + "0, 1" + (")" if open_high else "]")
            raise ValueError(f"{a.name} must lie in {span}, got {v!r}")

    return check


def one_of(*choices: Any) -> Callable[[Any, Any, Any], None]:
    """A validator: one of ``choices``."""

    def check(_inst: Any, a: Any, v: Any) -> None:
        if v not in choices:
            raise ValueError(f"{a.name} must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check


def existing_device(_inst: Any, _a: Any, v: Any) -> None:
    """A validator: a device that exists here (:func:`dspark.models.resolve_device`), so a typo or a
    missing GPU fails before a model loads."""
    from dspark.models import resolve_device

    resolve_device(v)


def path(value: str | os.PathLike[str]) -> str:
    """A converter: a path (``str`` or ``os.PathLike``) → ``str`` (what the JSON records hold)."""
    return os.fspath(value)


def optional_path(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


def strings(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """A converter: None → (), one string or path → a 1-tuple, an iterable → a tuple (paths as
    ``str``)."""
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (os.fspath(value),)
    return tuple(os.fspath(v) for v in value)


def ints(value: int | Iterable[int]) -> tuple[int, ...]:
    """A converter: one integer or an iterable of them → a tuple."""
    return (value,) if isinstance(value, int) else tuple(value)


def optional_ints(value: int | Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else ints(value)


def floats(value: float | Iterable[float]) -> tuple[float, ...]:
    """A converter: one number or an iterable of them → a tuple of floats."""
    return (float(value),) if _number(value) else tuple(float(x) for x in value)


class NamespaceOptions:
    """Mixin of the options classes: :meth:`from_namespace` maps the command line's parsed
    arguments onto the fields (``_CLI_NAMES`` lists fields whose argparse ``dest`` differs)."""

    __slots__ = ()
    _CLI_NAMES: dict[str, str] = {}

    @classmethod
    def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
        names = getattr(cls, "_CLI_NAMES", {})
        values = {}
        for f in attrs.fields(cls):  # type: ignore[arg-type]
            dest = names.get(f.name, f.name)
            if hasattr(args, dest):
                values[f.name] = getattr(args, dest)
        return cls(**values)


def resolve_options(cls: type[T], options: T | None, overrides: dict[str, Any]) -> T:
    """The options a typed function runs with: ``options`` (or the defaults) with keyword
    ``overrides`` applied, validated."""
    if options is None:
        return cls(**overrides)
    if not isinstance(options, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(options).__name__}")
    return attrs.evolve(options, **overrides) if overrides else options
