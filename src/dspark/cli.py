"""The ``dspark`` command line (same as ``python -m dspark``).

Subcommands register themselves in ``COMMANDS``; errors users can fix (bad input, a plugin that
fails to load, a missing optional package) print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from dspark import __version__

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    def deco(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (add_args, fn)
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# dspark plugins
# --------------------------------------------------------------------------------------------


def _plugins_args(p: argparse.ArgumentParser) -> None:
    p.description = "List every registered implementation per extension point."
    p.add_argument("--json", action="store_true", help="machine-readable output")


@command("plugins", _plugins_args)
def _plugins(args: argparse.Namespace) -> int:
    from dspark.plugins import EXTENSION_POINTS, list_plugins

    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind in EXTENSION_POINTS:
        print(f"{kind}:")
        entries = [r for r in rows if r["kind"] == kind]
        if not entries:
            print("  (none)")
        for r in entries:
            version = f" {r['version']}" if r["version"] else ""
            print(f"  {r['name']:<14} [{r['plugin']}{version}]  {r['description']}")
    return 0


# --------------------------------------------------------------------------------------------
# dspark demo (the README main job)
# --------------------------------------------------------------------------------------------


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Speculative decoding on the real SmolLM2-135M target: n-gram drafts scheduled by every "
        "built-in scheduler, verified losslessly, checked against the target's own greedy decode "
        "and its sampling distribution."
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--samples", type=int, default=4000, help="draws for the sampling check")
    p.add_argument("--out", default="out/demo", help="folder for demo.json and demo.md")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', an HF folder or a .gguf path")


@command("demo", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    from dspark.demo import run_demo

    return run_demo(args)


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="Confidence-scheduled speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, fn) in COMMANDS.items():
        p = sub.add_parser(name)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dspark.plugins import PluginError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (PluginError, ValueError, OSError, ImportError) as exc:
        print(f"dspark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dspark {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
