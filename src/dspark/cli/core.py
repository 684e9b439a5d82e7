"""The core of the ``dspark`` command line: the command registry, the options every command shares,
logging, the JSON output and the mapping of errors onto one line and an exit code.

Conventions every command follows (the registry enforces what it can):

* one flag per concept: ``--target`` names the target, ``--drafter NAME|DIR`` the drafter (a shipped
  drafter's name or a checkpoint folder), ``--out`` what the command writes;
* ``-v`` / ``-q`` set the level of the ``dspark`` loggers, where progress and notices go (stderr);
  results go to stdout;
* a command that reports takes ``--json``: one JSON object on stdout instead of the human text;
* a command whose options are an options class (:mod:`dspark.options`) declares them there, once:
  :func:`dspark.options.add_arguments` writes its argparse arguments.

Errors users can fix (bad input, a plugin that fails to load) print one line and exit 2; what the
environment must fix (a missing optional package, a device that failed) exits 3; never a traceback
unless ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dspark import __version__

__all__ = ["COMMANDS", "SUMMARIES", "build_parser", "command", "configure_logging", "emit", "main",
           "verbosity_parent"]

log = logging.getLogger("dspark.cli")

AddArgs = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]


class Command:
    """A registered subcommand: its arguments, its handler, its one-line summary for ``dspark
    --help`` and whether it reports (prints a result, hence takes ``--json``)."""

    def __init__(self, add_args: AddArgs, run: Handler, summary: str, reports: bool) -> None:
        self.add_args, self.run, self.summary, self.reports = add_args, run, summary, reports


COMMANDS: dict[str, Command] = {}
SUMMARIES: dict[str, str] = {}  # command → its line in `dspark --help` (each command's --help has the rest)


def command(name: str, add_args: AddArgs, *, summary: str, reports: bool = True) -> Callable[[Handler], Handler]:
    """Register the decorated handler as ``dspark NAME``, in the order ``dspark --help`` lists."""

    def deco(fn: Handler) -> Handler:
        COMMANDS[name] = Command(add_args, fn, summary, reports)
        SUMMARIES[name] = summary
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# Options every command shares
# --------------------------------------------------------------------------------------------


def verbosity_parent() -> argparse.ArgumentParser:
    """``-v`` / ``-q`` as a parent parser: every ``dspark`` command and ``python -m dspark.export``
    declare them from here (:func:`configure_logging` applies them)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output on stderr (-v: debug messages too)")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr, no progress")
    return p


def _json_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    return p


def target_arg(p: argparse.ArgumentParser, *, required: bool = False, help: str | None = None) -> None:
    """``--target`` (dest ``model``, as the options classes' field): the target model."""
    from dspark.options import TARGET_HELP

    extra = {"required": True} if required else {"default": "smollm2-135m"}
    p.add_argument("--target", dest="model", metavar="TARGET", help=help or TARGET_HELP, **extra)


def out_arg(p: argparse.ArgumentParser, help: str, default: str | None = None, required: bool = False) -> None:
    """``--out``: what the command writes."""
    p.add_argument("--out", metavar="OUT", help=help, **({"required": True} if required else {"default": default}))


def device_arg(p: argparse.ArgumentParser) -> None:
    from dspark.options import DEVICE_HELP

    p.add_argument("--device", default="cpu", help=DEVICE_HELP)


def path_args(p: argparse.ArgumentParser, *, race: bool) -> None:
    """``--step`` (and, where the step path is raced at start-up, ``--compile / --no-compile``)."""
    from dspark.options import COMPILE_HELP, RACED_STEP_HELP, STEP_HELP, STEP_PATHS

    if race:
        p.add_argument("--step", default="auto", choices=["auto", *STEP_PATHS], help=RACED_STEP_HELP)
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help=COMPILE_HELP)
    else:
        p.add_argument("--step", default="packed", choices=STEP_PATHS, help=STEP_HELP)


def emit(args: argparse.Namespace, result: dict[str, Any], text: str | Callable[[], str] | None) -> None:
    """The result of a command on stdout: ``result`` as one JSON object under ``--json``, else
    ``text`` (a string or a function making it; None: nothing)."""
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, default=str))
    elif text is not None:
        print(text() if callable(text) else text)


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a test's capture included)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(verbose: int, quiet: bool) -> Callable[[], None]:
    """Route the ``dspark`` loggers to stderr at the level -v / -q ask for; returns the undo."""
    logger = logging.getLogger("dspark")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(before)

    return undo


# --------------------------------------------------------------------------------------------
# The parser and the entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``dspark`` parser: every registered command with the shared options."""
    parser = argparse.ArgumentParser(prog="dspark", description="Confidence-scheduled speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verbosity, json_output = verbosity_parent(), _json_parent()
    for name, cmd in COMMANDS.items():
        parents = [verbosity, json_output] if cmd.reports else [verbosity]
        p = sub.add_parser(name, help=cmd.summary, parents=parents)
        cmd.add_args(p)
        p.set_defaults(func=cmd.run)
    return parser


# What a user can fix (exit 2) and what the environment must (exit 3): a missing optional package,
# a full disk, a device that failed. Anything else is reported as unexpected, still in one line.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, KeyError, TypeError, FileNotFoundError,
                                                 IsADirectoryError, NotADirectoryError, FileExistsError)
_ENVIRONMENT_ERRORS: tuple[type[BaseException], ...] = (ImportError, OSError, MemoryError, RuntimeError)


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    first = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return first or type(exc).__name__


def _silence_stdout() -> None:
    """After the reader of stdout left (``dspark plugins --json | head -1``): send what is still
    buffered nowhere, so the interpreter's flush at exit raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a replaced stdout without a descriptor
        pass
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter flushes stdout at exit
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``dspark ARGS``: run one command; the exit status (0 done, 1 a check failed, 2 bad input,
    3 the environment, 130 interrupted)."""
    from dspark.plugins import PluginError

    args = build_parser().parse_args(argv)
    undo = configure_logging(args.verbose, args.quiet)
    try:
        # what -v adds: the options the command runs with, defaults included (for a bug report)
        log.debug("dspark %s with %s", args.command,
                  ", ".join(f"{k}={v!r}" for k, v in sorted(vars(args).items()) if k not in ("func", "command")))
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        log.error("dspark %s: interrupted", args.command)
        return 130
    except BrokenPipeError:  # the reader left (`dspark plugins --json | head`): nothing is wrong
        _silence_stdout()
        return 0
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, (PluginError, *_USER_ERRORS)):
            code, what = 2, "error"
        elif isinstance(exc, _ENVIRONMENT_ERRORS):
            code, what = 3, "error"
        else:
            code, what = 3, f"unexpected error ({type(exc).__name__})"
        hint = "" if code == 2 else " (--debug shows the traceback)"
        print(f"dspark {args.command}: {what}: {_one_line(exc)}{hint}", file=sys.stderr)
        return code
    finally:
        undo()
