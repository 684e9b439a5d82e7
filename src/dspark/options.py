"""Shared pieces of the options objects behind the commands.

Each command (``dspark data``, ``train``, ``eval``, ``calibrate``, ``bench``, ``demo``) is a typed
library function taking an attrs ``@frozen`` options object (:class:`dspark.data.build.DataOptions`,
:class:`dspark.training.run.TrainOptions`, ...). Validators check values (ranges, choices,
contradicting options) when the object is built, each failure one sentence in a ``ValueError``;
what depends on the world at call time (files on disk, names in the plugin registry) is checked in
the first lines of the function, before any model loads.

An option is declared once, as a field made by :func:`option`: its default, validator and
converter, and in the field's metadata (an :class:`Arg`) how it appears on the command line — help,
flag name, choices. :func:`add_arguments` writes the argparse arguments of a command from its
options class, and :meth:`NamespaceOptions.from_namespace` reads the parsed values back (the
argparse ``dest`` of each argument is its field's name).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs

__all__ = [
    "CLI", "Arg", "NamespaceOptions", "STEP_PATHS", "add_arguments", "at_least", "comma_ints", "existing_device",
    "flag_name", "floats", "ints", "one_of", "option", "optional_ints", "optional_path", "path", "race_paths",
    "resolve_options", "strings", "unit_interval",
    "COMPILE_HELP", "DEVICE_HELP", "DRAFTER_HELP", "GATE_HELP", "RACED_STEP_HELP", "STEP_HELP", "TARGET_HELP",
]

T = TypeVar("T")

# How the target step runs (dspark.fast): the HF forward, dspark's step with prepacked weights, or
# that step through torch.compile. "auto" races them at start-up (dspark.autotune.choose_dtype).
STEP_PATHS = ("eager", "packed", "compiled")


# Help shared by the commands that take the same option (one wording per concept).
TARGET_HELP = "the target model: 'smollm2-135m', an HF folder or a .gguf path"
DRAFTER_HELP = ("a shipped drafter's name or a checkpoint folder (NAME:vocab=K: cut to its K most frequent "
                "tokens, docs/drafters-and-training.md)")
DEVICE_HELP = "where the target and drafter run: cpu, cuda, cuda:N or auto (CUDA when torch sees one)"
STEP_HELP = ("how the target step runs: eager (the HF forward), packed (dspark's step with prepacked "
             "weights), compiled (that step through torch.compile)")
RACED_STEP_HELP = STEP_HELP + "; 'auto': raced at start-up together with the dtype"
COMPILE_HELP = ("let the 'auto' race try torch.compile (default: on a GPU only; on a CPU each graph compiles "
                "for minutes at start-up, docs/serving-and-benchmarks.md)")
GATE_HELP = "the draft gate: stop drafting where the measured rates say it does not pay"


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
    arguments (each argparse ``dest`` a field name, :func:`add_arguments`) onto the fields."""

    __slots__ = ()

    @classmethod
    def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
        values = {f.name: getattr(args, f.name) for f in attrs.fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
        return cls(**values)


# --------------------------------------------------------------------------------------------
# Options declared once: the field carries its command-line form
# --------------------------------------------------------------------------------------------

CLI = "dspark.cli"
"""The attrs metadata key of a field's :class:`Arg`."""


@attrs.frozen
class Arg:
    """How an options field appears on the command line. ``flag``: the option's name when it is not
    ``--field-name`` (e.g. ``--target`` for the ``model`` field); ``positional``: an argument
    without a flag; ``choices``: the values allowed (validated by the field too); ``type``, ``nargs``,
    ``append`` (a repeatable option) and ``metavar`` as argparse has them, inferred from the field's
    annotation when not given."""

    help: str
    flag: str | None = None
    positional: bool = False
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    append: bool = False


def option(default: Any = attrs.NOTHING, *, help: str, flag: str | None = None, positional: bool = False,
           choices: Iterable[Any] | None = None, metavar: str | None = None,
           type: Callable[[str], Any] | None = None, nargs: str | None = None, append: bool = False,
           validator: Callable[[Any, Any, Any], None] | None = None,
           converter: Callable[[Any], Any] | None = None) -> Any:
    """An options field and its command-line form in one declaration: ``choices`` are validated
    (:func:`one_of`) as well as offered; no ``default`` makes the option required."""
    choices = tuple(choices) if choices is not None else None
    checks = ([one_of(*choices)] if choices else []) + ([validator] if validator else [])
    spec = Arg(help, flag, positional, choices, metavar, type, nargs, append)
    return attrs.field(default=default, validator=checks or None, converter=converter, metadata={CLI: spec})


def comma_ints(text: str) -> list[int]:
    """An argparse type: ``"1,2,4"`` → ``[1, 2, 4]``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def flag_name(field: Any) -> str:
    """The command-line flag of an options field: its :class:`Arg`'s ``flag`` or ``--field-name``."""
    spec = field.metadata.get(CLI)
    return (spec.flag if spec is not None and spec.flag else None) or "--" + field.name.replace("_", "-")


_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def _annotation(field: Any) -> str:
    t = field.type
    text = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return text.replace(" | None", "").replace("Optional[", "").strip()


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argparse argument per field of ``cls`` that carries an :class:`Arg`, in field order, its
    ``dest`` the field's name and its default the field's. Fields without one (``quiet``: the global
    ``-q``) are filled from the namespace by :meth:`NamespaceOptions.from_namespace` all the same."""
    for f in attrs.fields(cls):
        spec: Arg | None = f.metadata.get(CLI)
        if spec is None:
            continue
        default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore[attr-defined]
        required = default is attrs.NOTHING
        kind = _annotation(f)
        kw: dict[str, Any] = {"help": spec.help}
        if spec.choices is not None:
            kw["choices"] = list(spec.choices)
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if default is not False else "store_true"
        else:
            element = kind[len("tuple["):-len(", ...]")] if kind.startswith("tuple[") else None
            if spec.type is not None:
                kw["type"] = spec.type
            elif element == "int":
                kw["type"] = comma_ints
            elif element is not None:
                kw["type"] = _SCALARS.get(element, str)
            else:
                kw["type"] = _SCALARS.get(kind, str)
            append = spec.append or (element == "str" and spec.type is None and spec.nargs is None
                                     and not spec.positional)
            if append:
                kw["action"] = "append"
            nargs = spec.nargs or ("+" if element == "float" and spec.type is None else None)
            if nargs:
                kw["nargs"] = nargs
            if spec.metavar or (spec.flag and not spec.positional):
                kw["metavar"] = spec.metavar or spec.flag.lstrip("-").replace("-", "_").upper()
            default = None if append or required else default
        if spec.positional:
            parser.add_argument(f.name, **kw)
            continue
        flag = flag_name(f)
        if required:
            kw["required"] = True
        else:
            kw["default"] = default
        parser.add_argument(flag, dest=f.name, **kw)


def resolve_options(cls: type[T], options: T | None, overrides: dict[str, Any]) -> T:
    """The options a typed function runs with: ``options`` (or the defaults) with keyword
    ``overrides`` applied, validated."""
    if options is None:
        return cls(**overrides)
    if not isinstance(options, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(options).__name__}")
    return attrs.evolve(options, **overrides) if overrides else options
