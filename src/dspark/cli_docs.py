"""Markdown reference of the command line, rendered from the argparse parsers themselves.

``python -m dspark.cli_docs > docs/cli.md`` regenerates ``docs/cli.md``; ``tests/test_docs.py``
fails when the file and :func:`cli_reference` disagree. Every ``dspark`` subcommand comes from
:func:`dspark.cli.build_parser`, and ``python -m dspark.export`` from
:func:`dspark.export.cli.build_parser`. The output does not depend on the terminal: usage lines are
formatted at a fixed, very large width (one line each) and nothing reads ``COLUMNS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["cli_reference", "main"]

REGENERATE = "python -m dspark.cli_docs > docs/cli.md"
_WIDTH = 10_000  # usage on one line, whatever the terminal


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _usage(parser: argparse.ArgumentParser) -> str:
    fmt = argparse.HelpFormatter(parser.prog, width=_WIDTH)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return " ".join(fmt.format_help().split())


def _cell(text: str) -> str:
    """One Markdown table cell: a single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    tick = "``" if "`" in text else "`"
    pad = " " if tick == "``" else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def _option(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return _code(names)
        metavar = argparse.HelpFormatter("x", width=_WIDTH)._format_args(
            action, action.dest.upper()
        )
        return _code(f"{names} {metavar}")
    metavar = action.metavar or action.dest
    suffix = {"?": " (optional)", "*": " …", "+": " …", argparse.REMAINDER: " …"}.get(
        action.nargs, ""
    )
    return _code(str(metavar)) + suffix


def _required(action: argparse.Action) -> bool:
    # Computed here, not read from ``action.required``: Python versions differ on positionals
    # with nargs="..." (REMAINDER), which accept zero values.
    if action.option_strings:
        return bool(action.required)
    return action.nargs not in ("?", "*", argparse.REMAINDER)


def _default(action: argparse.Action) -> str:
    if _required(action):
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    if isinstance(action, argparse._VersionAction):
        return ""
    default = action.default
    if (
        default is None
        or default is argparse.SUPPRESS
        or (not action.option_strings and default == [])
    ):
        return ""
    if isinstance(default, (list, tuple)):
        default = ", ".join(str(v) for v in default)
    return _code(str(default))


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    if "%" in text:
        fmt = argparse.HelpFormatter(prog, width=_WIDTH)
        text = fmt._expand_help(action)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(_code(str(c)) for c in action.choices)
        text = f"{text}; one of {choices}" if text else f"one of {choices}"
    return _cell(text)


def _documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and a.help is not argparse.SUPPRESS
    ]


def _section(parser: argparse.ArgumentParser, heading: str) -> list[str]:
    lines = [f"## `{heading}`", "", "```text", f"usage: {_usage(parser)}", "```", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    actions = _documented(parser)
    if actions:
        lines += ["| option | default | help |", "| --- | --- | --- |"]
        lines += [f"| {_option(a)} | {_default(a)} | {_help(a, parser.prog)} |" for a in actions]
        lines.append("")
    for group in parser._mutually_exclusive_groups:
        names = " / ".join(
            _code(a.option_strings[0]) for a in group._group_actions if a.option_strings
        )
        kind = "exactly one" if group.required else "at most one"
        lines += [f"Mutually exclusive ({kind}): {names}.", ""]
    return lines


def cli_reference() -> str:
    """The Markdown of ``docs/cli.md``: every ``dspark`` subcommand and ``python -m dspark.export``."""
    from dspark.cli import build_parser
    from dspark.export.cli import build_parser as build_export_parser

    parser = build_parser()
    export = build_export_parser()
    subs = _subcommands(parser)
    lines = [
        "# Command-line reference",
        "",
        f"Generated from the argparse parsers by `{REGENERATE}` — do not edit by hand;",
        "`tests/test_docs.py` fails when this file and the parsers disagree. Commands in the order",
        "`dspark --help` lists them; `dspark X` is the same as `python -m dspark X`. Errors a user can",
        "fix print one line and exit 2.",
        "",
        "One convention throughout: `--target` names the target model, `--drafter NAME|DIR` a drafter (a",
        "shipped drafter's name or a checkpoint folder), `--out` what a command writes. Every command",
        "takes `-v` / `-q` (more or less log output on stderr: progress and notices) and every command",
        "that prints a result takes `--json` (the result as one JSON object on stdout).",
        "",
        f"* [`{parser.prog}`](#{_slug(parser.prog)})",
    ]
    lines += [f"* [`{p.prog}`](#{_slug(p.prog)})" for p in subs.values()]
    lines += [f"* [`{export.prog}`](#{_slug(export.prog)})", ""]
    lines += _section(parser, parser.prog)
    for sub in subs.values():
        lines += _section(sub, sub.prog)
    lines += _section(export, export.prog)
    return "\n".join(lines).rstrip("\n") + "\n"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading made of one code span (lower case, spaces → hyphens)."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m dspark.cli_docs",
        description=f"Print the Markdown command-line reference ({REGENERATE}).",
    ).parse_args(argv)
    text = cli_reference()
    out = sys.stdout
    if hasattr(out, "buffer"):
        out.flush()
        out.buffer.write(text.encode("utf-8"))
        out.buffer.flush()
    else:  # pragma: no cover - a replaced stdout (e.g. captured) takes str
        out.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
