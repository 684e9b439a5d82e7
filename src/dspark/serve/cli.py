"""``dspark serve``: the options, the engine build and the uvicorn run.

The target, drafter, dtype, step, gate, scheduler, device and seed options are the very argparse
declarations of ``dspark demo`` and ``dspark generate`` (copied from their parsers, not
re-declared), so the commands cannot drift apart. This module imports nothing heavy at import
time: ``dspark --help`` must stay fast and must work without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["add_args", "build_engine", "run"]

log = logging.getLogger("dspark.serve")

# option dests reused from `dspark demo` (the drafter as NAME|DIR, the scheduler spec, the vocabulary-cut
# race) and `dspark generate`
_FROM_DEMO = ("drafter", "scheduler", "vocab_cut")
_FROM_GENERATE = ("model", "dtype", "step", "compile", "gate", "device", "seed")


def _copy_actions(p: argparse.ArgumentParser, declare: Callable[[argparse.ArgumentParser], None],
                  dests: tuple[str, ...]) -> None:
    donor = argparse.ArgumentParser(add_help=False)
    declare(donor)
    for action in donor._actions:
        if action.dest in dests:
            p._add_action(action)


def add_args(p: argparse.ArgumentParser, demo_args: Callable, generate_args: Callable) -> None:
    p.description = (
        "An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions with streaming, /v1/models, "
        "/health, /metrics) on the speculative engine, continuously batching every connection's requests "
        "(docs/serve.md). --drafter also takes 'ngram' (no weights) or 'none' (plain decoding). Needs the "
        "serve extra: pip install 'dspark[serve]'."
    )
    _copy_actions(p, demo_args, _FROM_DEMO)
    _copy_actions(p, generate_args, _FROM_GENERATE)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: --target as given)")


def build_engine(args: argparse.Namespace) -> Any:
    """The engine ``dspark serve`` runs: the target in the measured (or given) dtype and step path,
    the drafter with its own calibration, the measured verification profile as cost model."""
    import torch

    from dspark.autotune import choose_dtype
    from dspark.bench.runner import build_lossless, parse_scheduler_spec
    from dspark.engine import Engine
    from dspark.gating import DraftGate
    from dspark.models import load_causal_lm
    from dspark.options import race_paths

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in 0..65535, got {args.port}")
    spec = parse_scheduler_spec(args.scheduler)  # a bad or lossy scheduler fails before the model load
    if spec.plain:
        raise ValueError("--scheduler plain: serve plain decoding with --drafter none instead")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a lossy scheduler's warning: refused with the reason instead
        scheduler = build_lossless(spec, "the server only runs schedules that preserve the target's distribution")
    folder = draft_vocab = None
    if args.drafter not in ("none", "ngram"):
        from dspark.checkpoints import resolve_checkpoint
        from dspark.drafters.prune import parse_drafter_ref

        name, draft_vocab = parse_drafter_ref(args.drafter)
        folder = resolve_checkpoint(name)  # a missing checkpoint fails before the model load
    model, tok = load_causal_lm(args.model, torch.float32, args.device)
    gamma = 7 if folder is None else _checkpoint_gamma(folder)
    context = min(256, int(model.config.max_position_embeddings) // 2)
    choice, target = choose_dtype(model, tok, context=context, gamma=0 if args.drafter == "none" else gamma,
                                  dtype=args.dtype, paths=race_paths(args.step, args.compile, args.device))
    log.info("%s", choice.reason)
    cost = choice.cost_model(args.model)
    calibrator = None
    if args.drafter == "none":
        drafter = None
    elif args.drafter == "ngram":
        import dspark

        drafter = dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=gamma)
    elif getattr(target, "path", None) == "compiled":  # the drafter's runner and vocabulary cut race too
        from dspark.fast.drafter import fastest_drafter

        setup = fastest_drafter(folder, target, _timing_prompts(tok), cost, choice.profile[gamma + 1],
                                draft_vocab=draft_vocab, race_cut=args.vocab_cut)
        drafter, calibrator = setup.drafter, setup.calibrator
    else:
        from dspark.drafters.checkpoint import from_pretrained
        from dspark.evaluation.drafter_specs import folder_calibrator

        drafter = from_pretrained(folder, target, draft_vocab=draft_vocab)
        calibrator = folder_calibrator(folder, draft_vocab)  # None under a calibrated confidence.json
    engine = Engine(target, drafter, scheduler=scheduler, cost_model=cost,
                    calibrator=calibrator or "identity", seed=args.seed,
                    draft_gate=DraftGate() if args.gate and drafter is not None else None)
    if getattr(target, "path", None) == "compiled":  # compile every shape class now, not mid-request
        from dspark.fast.warm import warm_up

        warm_up(target, drafter, engine.encode("Hello"), cost_model=engine.cost_model)
    return engine


def _timing_prompts(tok: Any) -> list[Any]:
    """Two of the shipped evaluation prompts, encoded: what the start-up times draft rounds on."""
    from dspark.data.natural.common import SHIPPED_EVAL
    from dspark.data.prompts import prompt_request
    from dspark.engine import encode_prompt
    from dspark.evaluation.inputs import eval_prompts

    return [encode_prompt(tok, prompt_request(p)) for p in eval_prompts(str(SHIPPED_EVAL), 1)[:2]]


def _checkpoint_gamma(folder: Any) -> int:
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(folder) / "config.json").read_text()).get("gamma", 7))
    except (OSError, ValueError, TypeError):
        return 7


def run(args: argparse.Namespace) -> int:
    """Build the engine and serve it until interrupted."""
    try:
        import uvicorn

        from dspark.serve.app import create_app
    except ImportError as exc:
        raise ImportError(f"dspark serve needs the serve extra (pip install 'dspark[serve]'): {exc}") from None
    engine = build_engine(args)
    name = args.served_model_name or args.model
    app = create_app(engine, name)
    log.info("dspark serve: %s with drafter %s on http://%s:%d", name, args.drafter, args.host, args.port)
    # on Ctrl-C, open streams get 5 s to end; then they are cancelled and their requests aborted
    level = "warning" if args.quiet else "debug" if args.verbose else "info"  # the global -q / -v
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, timeout_graceful_shutdown=5)
    return 0
