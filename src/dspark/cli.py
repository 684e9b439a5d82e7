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
# dspark generate
# --------------------------------------------------------------------------------------------


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.description = "Generate with speculative decoding and print the text and per-request stats."
    p.add_argument("prompts", nargs="+", help="one or more prompts (each a chat user turn)")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', an HF folder or a .gguf path")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--drafter", default="ngram", help="drafter name (ngram, dspark, dflash, eagle3, plugins) or 'none'")
    p.add_argument("--checkpoint", help="drafter checkpoint folder (neural drafters)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--scheduler", default="sps-greedy")
    p.add_argument("--cost-model", default="sps-table")
    p.add_argument("--profile", help="SPS profile JSON for sps-table (default: the shipped CPU profile)")
    p.add_argument("--calibrator", default="identity", help="calibrator name or a fitted calibrator JSON")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per request")


@command("generate", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    import os
    import time

    import torch

    import dspark
    from dspark.engine import Engine
    from dspark.targets import load_target

    params = dspark.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target = load_target(args.model, dtype)
    if args.drafter == "none":
        drafter = None
    elif args.drafter == "ngram":
        drafter = dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=args.gamma)
    elif args.checkpoint:
        drafter = dspark.get_drafter(args.drafter, target=target, checkpoint=args.checkpoint)
    else:
        drafter = dspark.get_drafter(args.drafter, target=target, gamma=args.gamma)
        print(f"note: {args.drafter} drafter without --checkpoint is untrained (random weights)", file=sys.stderr)
    if os.path.isfile(args.calibrator):
        from dspark.calibration import load_calibrator

        calibrator = load_calibrator(args.calibrator)
    else:
        calibrator = args.calibrator
    cost = dspark.get_cost_model(args.cost_model, **({"profile": args.profile} if args.profile else {}))
    engine = Engine(target, drafter, scheduler=args.scheduler, cost_model=cost, calibrator=calibrator,
                    seed=args.seed)
    t0 = time.perf_counter()
    done = engine.generate(args.prompts, params, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t0
    for c in done:
        stats = {**c.metrics, "new_tokens": len(c.output_ids), "finish_reason": c.finish_reason}
        if args.json:
            print(json.dumps({"request_id": c.request_id, "text": c.text, **stats}))
        else:
            print(f"--- {c.request_id} ---\n{c.text}")
            print(f"[{stats['new_tokens']} tokens, {stats['rounds']} rounds, τ = {stats['tau']:.2f}, "
                  f"mean ℓ = {stats['mean_verified']:.2f}, finish: {stats['finish_reason']}]")
    total = sum(len(c.output_ids) for c in done)
    print(f"{total} tokens in {seconds:.1f} s ({total / seconds:.1f} tok/s)", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# dspark export (same as python -m dspark.export)
# --------------------------------------------------------------------------------------------


def _export_args(p: argparse.ArgumentParser) -> None:
    p.description = "Export a drafter checkpoint to ONNX / TensorRT (see python -m dspark.export --help)."
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for python -m dspark.export")


@command("export", _export_args)
def _export(args: argparse.Namespace) -> int:
    from dspark.export.cli import main as export_main

    return export_main(args.args)


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
