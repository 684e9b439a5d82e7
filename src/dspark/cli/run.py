"""``dspark demo`` (the README main job) and ``dspark generate`` (text with speculative decoding)."""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from typing import Any

from dspark.cli.core import command, device_arg, emit, path_args, target_arg

log = logging.getLogger("dspark.cli")

# --------------------------------------------------------------------------------------------
# dspark demo
# --------------------------------------------------------------------------------------------


def demo_args(p: argparse.ArgumentParser) -> None:
    """``dspark demo``'s options: :class:`dspark.demo.DemoOptions`'s fields."""
    from dspark.demo import DemoOptions
    from dspark.options import add_arguments

    p.description = (
        "The main job on the real SmolLM2-135M target with a shipped trained drafter: greedy identity "
        "with the target (fp32), a sampling-distribution check, and the wall-clock speed-up over the "
        "best plain decode at concurrency 1, measured side by side in the dtype that is faster on this "
        "machine (measured at start-up)."
    )
    add_arguments(p, DemoOptions)


@command("demo", demo_args, summary="the main job: identity, sampling check and speed-up on the real target")
def _demo(args: argparse.Namespace) -> int:
    from dspark.demo import DemoOptions, run_demo

    demo = run_demo(DemoOptions.from_namespace(args))
    emit(args, demo.result, demo.markdown)
    log.info("wrote %s and %s", demo.out / "demo.json", demo.out / "demo.md")
    if not demo.all_identical:
        log.error("ERROR: a speculative output differs from the target's greedy decode")
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# dspark generate
# --------------------------------------------------------------------------------------------


def generate_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Generate with speculative decoding and print the text and per-request stats. At start-up the "
        "target's dtype is chosen by measurement (the faster plain step on this machine, a few seconds) "
        "unless --dtype fixes it, and the verification profile measured for it is the cost model "
        "(unless --profile or another --cost-model is given); the draft gate stops drafting where the "
        "measured rates say it does not pay."
    )
    from dspark.options import GATE_HELP

    p.add_argument("prompts", nargs="+", help="one or more prompts (each a chat user turn)")
    target_arg(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype ('auto': the faster plain step, measured at start-up)")
    path_args(p, race=True)
    p.add_argument("--drafter", default="ngram", metavar="NAME|DIR",
                   help="a shipped drafter's name or a checkpoint folder (NAME:vocab=K: cut to its K most frequent "
                   "tokens), ngram (no weights), none (plain decoding), or a drafter kind a plugin registers "
                   "(dspark, dflash, eagle3: untrained, random weights)")
    p.add_argument("--gamma", type=int, help="draft block size γ (default 7; a trained drafter fixes its own)")
    p.add_argument("--scheduler", default="sps-greedy", help="the engine's scheduler, NAME[:KEY=VALUE,...]")
    p.add_argument("--cost-model", default="sps-table", help="the scheduler's cost model (a registered name)")
    p.add_argument("--profile", help="SPS profile JSON for sps-table (default: measured at start-up)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True, help=GATE_HELP)
    p.add_argument("--calibrator", default="identity", help="calibrator name or a fitted calibrator JSON")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus (top-p) mass of the sampling")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    device_arg(p)


def _trained_drafter(name: str) -> tuple[Any, int | None] | None:
    """``(folder, draft_vocab)`` when ``name`` is a shipped drafter or a checkpoint folder (a missing
    folder fails here, before the model load), None when it is a registered drafter kind to build
    fresh; a name that is neither fails as an unknown drafter."""
    from dspark.checkpoints import locate, resolve_checkpoint, shipped
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.plugins import lookup, registry

    path, draft_vocab = parse_drafter_ref(name)
    if (locate(path) / "config.json").is_file() or "/" in path or os.sep in path:
        return resolve_checkpoint(path), draft_vocab
    if path not in registry()["drafters"]:
        try:
            lookup("drafters", path)  # the unknown-name error, with the registered names
        except ValueError as exc:
            raise ValueError(f"{exc}; shipped drafters: {', '.join(shipped()) or 'none'}") from None
    if draft_vocab is not None:
        raise ValueError(f"{name}: ':vocab=K' cuts a trained drafter (a shipped name or a checkpoint folder), "
                         f"and {path} is a drafter kind")
    return None


def _check_generate(args: argparse.Namespace) -> tuple[Any, Any, bool]:
    """Everything that can be checked without the model, before its load. Returns the trained
    drafter (``(folder, draft_vocab)``, None for ngram / none / a fresh kind), the block size γ and
    whether ``--calibrator`` names a file."""
    import dspark
    from dspark.drafters.config import MAX_GAMMA
    from dspark.plugins import lookup

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    empty = [i + 1 for i, p in enumerate(args.prompts) if not p.strip()]
    if empty:
        raise ValueError(f"prompt {', '.join(map(str, empty))} is empty")
    trained = None
    if args.drafter not in ("none", "ngram"):
        trained = _trained_drafter(args.drafter)
    with warnings.catch_warnings():  # a lossy scheduler warns as it is built: refused below instead
        warnings.simplefilter("ignore")
        scheduler = dspark.get_scheduler(args.scheduler)
    if not getattr(scheduler, "lossless", False):  # what the engine refuses, before the model load
        raise ValueError(f"scheduler {args.scheduler!r} is not lossless; the engine only runs schedules that "
                         "preserve the target's distribution")
    lookup("cost_models", args.cost_model)
    looks_like_file = args.calibrator.endswith(".json") or "/" in args.calibrator
    if looks_like_file and not os.path.isfile(args.calibrator):
        raise ValueError(f"calibrator file {args.calibrator} does not exist")
    if not looks_like_file:
        lookup("calibrators", args.calibrator)
    if trained is not None and args.gamma is not None:
        raise ValueError("--gamma cannot be combined with a trained drafter: the checkpoint fixes its block size γ")
    gamma = 7 if args.gamma is None else args.gamma
    if not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"--gamma must lie in 1..{MAX_GAMMA}, got {gamma}")
    return trained, gamma, looks_like_file


@command("generate", generate_args, summary="generate text with speculative decoding")
def _generate(args: argparse.Namespace) -> int:
    import torch

    import dspark
    from dspark.autotune import choose_dtype
    from dspark.engine import Engine, encode_prompt
    from dspark.models import load_causal_lm
    from dspark.options import race_paths

    params = dspark.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    trained, gamma, calibrator_file = _check_generate(args)
    model, tok = load_causal_lm(args.model, torch.float32, args.device)  # a device not here fails before the load
    longest = max(encode_prompt(tok, p).numel() for p in args.prompts)
    measured_cost = args.cost_model == "sps-table" and not args.profile
    choice, target = choose_dtype(model, tok, context=longest + args.max_new_tokens // 2,
                                  gamma=gamma if measured_cost else 0, dtype=args.dtype,
                                  paths=race_paths(args.step, args.compile, args.device))
    del model
    log.info("%s", choice.reason)
    if args.drafter == "none":
        drafter = None
    elif args.drafter == "ngram":
        drafter = dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=gamma)
    elif trained is not None:
        from dspark.drafters.checkpoint import from_pretrained

        drafter = from_pretrained(trained[0], target, draft_vocab=trained[1])
    else:
        drafter = dspark.get_drafter(args.drafter, target=target, gamma=gamma)
        log.warning("note: the %s drafter is untrained (random weights): give a shipped drafter's name or a "
                    "checkpoint folder as --drafter", args.drafter)
    if calibrator_file:
        from dspark.calibration import load_calibrator

        calibrator = load_calibrator(args.calibrator)
    else:
        calibrator = args.calibrator
    if measured_cost:
        cost = choice.cost_model(args.model)
    else:
        cost = dspark.get_cost_model(args.cost_model, **({"profile": args.profile} if args.profile else {}))
    engine = Engine(target, drafter, scheduler=args.scheduler, cost_model=cost, calibrator=calibrator,
                    draft_gate=args.gate and drafter is not None, seed=args.seed)
    t0 = time.perf_counter()
    done = engine.generate(args.prompts, params, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t0
    requests = [{"request_id": c.request_id, "text": c.text, **c.metrics, "new_tokens": len(c.output_ids),
                 "finish_reason": c.finish_reason} for c in done]
    total = sum(r["new_tokens"] for r in requests)
    gate = engine.draft_gate
    result = {"requests": requests, "new_tokens": total, "seconds": seconds, "configuration": choice.label,
              "rounds": engine.rounds, "gate_skipped_rounds": gate.skipped_rounds if gate else None}
    emit(args, result, lambda: _generate_text(requests))
    skipped = f", the draft gate skipped the drafter in {gate.skipped_rounds} of {engine.rounds} rounds" if gate else ""
    log.info("%d tokens in %.1f s (%.1f tok/s, %s%s)", total, seconds, total / seconds, choice.label, skipped)
    return 0


def _generate_text(requests: list[dict]) -> str:
    lines = []
    for r in requests:
        lines.append(f"--- {r['request_id']} ---\n{r['text']}")
        lines.append(f"[{r['new_tokens']} tokens, {r['rounds']} rounds, τ = {r['tau']:.2f}, "
                     f"mean ℓ = {r['mean_verified']:.2f}, finish: {r['finish_reason']}]")
    return "\n".join(lines)
