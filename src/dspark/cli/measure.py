"""``dspark eval``, ``dspark profile`` and ``dspark bench``: measuring drafters (acceptance,
calibration), the target's verification step (the cost profile) and the engine under load."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from dspark.cli.core import command, device_arg, emit, path_args, target_arg

log = logging.getLogger("dspark.cli")

# --------------------------------------------------------------------------------------------
# dspark eval
# --------------------------------------------------------------------------------------------


def _eval_args(p: argparse.ArgumentParser) -> None:
    from dspark.evaluation.eval_run import EvalOptions
    from dspark.options import add_arguments

    p.description = (
        "Evaluate drafters per domain: τ, proposal length, verify rate, conditional acceptance and "
        "prefix survival per position, threshold sweep, confidence metrics (JSON, Markdown, PNG)."
    )
    add_arguments(p, EvalOptions)


@command("eval", _eval_args, summary="evaluate drafters: τ, acceptance, calibration per domain")
def _eval(args: argparse.Namespace) -> int:
    from dspark.evaluation.eval_run import EvalOptions, evaluate

    ev = evaluate(EvalOptions.from_namespace(args))
    taus = ", ".join(f"{run} τ = {tau:.2f}" for run, tau in ev.tau.items())
    emit(args, ev.results, taus)
    log.info("wrote %s, eval.md, acceptance.png", ev.json_path)
    return 0


# --------------------------------------------------------------------------------------------
# dspark profile
# --------------------------------------------------------------------------------------------


def _profile_args(p: argparse.ArgumentParser) -> None:
    from dspark.options import DRAFTER_HELP, comma_ints

    p.description = (
        "Measure the target's verification step time over the batch shapes the engine runs (R requests "
        "× 1+ℓ tokens, padded) and context lengths, and write the profile JSON the sps-table cost model "
        "reads (records device, model, dtype, threads, date). Also reports the memory-traffic floor of a "
        "step (the weights' bytes over the read bandwidth measured here) and, with --drafter, the draft "
        "round's time beyond a plain round and its own floor (the weights every round reads)."
    )
    p.add_argument("--out", default="out/profile.json",
                   help="profile JSON for --profile / sps-table (its .shapes.json and .floor.json beside it)")
    target_arg(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's dtype")
    path_args(p, race=False)
    p.add_argument("--requests", type=comma_ints, default=[1, 2, 4, 8, 16], help="R values, e.g. 1,2,4,8,16")
    p.add_argument("--widths", type=comma_ints, default=[1, 2, 4, 8], help="1+ℓ values (tokens per request)")
    p.add_argument("--contexts", type=comma_ints, default=[128, 512],
                   help="KV-cache lengths; the first sets the profile's points and α(R), every other one "
                   "a curve of the profile's `contexts` (the engine reads the curves at each round's context)")
    p.add_argument("--repeats", type=int, default=5, help="timed sweeps over the shapes (median kept)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    device_arg(p)
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--drafter", metavar="NAME|DIR",
                   help="also time this drafter's round at each R of --requests: " + DRAFTER_HELP)


def _step_tables(args: argparse.Namespace, target: Any, times: dict, plain: dict, threads: int) -> str:
    """Per context: the step of each (R, 1 + ℓ) after another shape, and R's one-token step back to back."""
    from dspark.profiling import device_name

    lines = []
    for ctx in args.contexts:
        lines += [f"\nverification step (ms), {args.dtype}, {target.path} step, {ctx}-token context, "
                  f"{device_name(target)}, {threads} threads (each after another shape; last column: "
                  "one token back to back, as plain decoding runs):",
                  "| R \\ 1+ℓ | " + " | ".join(str(w) for w in args.widths) + " | plain |",
                  "|---|" + "---|" * (len(args.widths) + 1)]
        lines += [f"| {R} | " + " | ".join(f"{times[ctx, R, w] * 1e3:.1f}" for w in args.widths)
                  + f" | {plain[ctx, R] * 1e3:.1f} |" for R in args.requests]
    return "\n".join(lines)


@command("profile", _profile_args, summary="measure the verification step and write a cost profile")
def _profile(args: argparse.Namespace) -> int:
    import torch

    from dspark.profiling import (
        bytes_floor,
        device_name,
        profile_from_shapes,
        save_shapes,
        time_profile,
        traffic_floor,
    )
    from dspark.targets import load_target

    if args.drafter:
        from dspark.checkpoints import resolve_checkpoint
        from dspark.drafters.prune import parse_drafter_ref

        resolve_checkpoint(parse_drafter_ref(args.drafter)[0])  # a misspelled name fails before the model load
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, getattr(torch, args.dtype), device=args.device, path=args.step)
    times, plain = time_profile(target, args.requests, args.widths, args.contexts, args.repeats, args.seed,
                                progress=not args.quiet)
    floor = traffic_floor(target.model)
    profile = profile_from_shapes(times, model=args.model, dtype=args.dtype, device=device_name(target),
                                  repeats=args.repeats, plain=plain)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(out)
    save_shapes(times, out.with_suffix(".shapes.json"))
    lines = [_step_tables(args, target, times, plain, torch.get_num_threads())]
    ctx, R1 = args.contexts[0], min(args.requests)
    t1 = times[ctx, R1, min(args.widths)]
    lines.append(f"\nmemory-traffic floor: {floor['floor_seconds'] * 1e3:.1f} ms a step ({floor['weight_bytes'] / 1e6:.0f} "
                 f"MB of weights at {floor['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s read); the {R1}-request "
                 f"{min(args.widths)}-token step at a {ctx}-token context is {t1 / floor['floor_seconds']:.2f}× the floor")
    report: dict[str, Any] = {"step": target.path, "dtype": args.dtype, "traffic_floor": floor}
    if args.drafter:
        drafter, report["draft_round_seconds"] = _draft_rounds(target, args, profile)
        if hasattr(drafter, "round_weight_bytes"):  # a neural drafter (the n-gram one has no weights)
            draft = report["draft_traffic_floor"] = bytes_floor(drafter.round_weight_bytes(),
                                                                floor["bandwidth_bytes_per_second"])
            lines.append(f"draft round floor: {draft['floor_seconds'] * 1e3:.1f} ms ({draft['weight_bytes'] / 1e6:.1f} "
                         f"MB of weights every round reads, {draft['weight_bytes'] / floor['weight_bytes']:.0%} "
                         "of a step's)")
        for R, sec in report["draft_round_seconds"].items():
            ref = times[ctx, R, max(args.widths)] if (ctx, R, max(args.widths)) in times else float("nan")
            lines.append(f"draft round beyond a plain round, R = {R}: {sec * 1e3:.1f} ms "
                         f"({sec / ref:.0%} of the {max(args.widths)}-token verification step)")
    out.with_suffix(".floor.json").write_text(json.dumps(report, indent=2) + "\n")
    shapes = [{"context": c, "requests": r, "tokens_per_request": w, "seconds": s} for (c, r, w), s in times.items()]
    emit(args, {**report, "profile": out, "shapes_path": out.with_suffix(".shapes.json"),
                "floor_path": out.with_suffix(".floor.json"), "shapes": shapes}, "\n".join(lines))
    log.info("wrote %s (sps-table profile), %s and %s", out, out.with_suffix(".shapes.json"),
             out.with_suffix(".floor.json"))
    return 0


def _draft_rounds(target: Any, args: argparse.Namespace, profile: Any) -> tuple[Any, dict[int, float]]:
    """``--drafter`` on ``target`` and {R: seconds a drafted round spends beyond a plain one}."""
    import dspark
    from dspark.bench.prior import measure_draft_overhead
    from dspark.engine import encode_prompt
    from dspark.evaluation.drafter_specs import load_drafter_spec

    _, drafter, calibrator = load_drafter_spec(args.drafter, target)
    ids = [encode_prompt(target.tokenizer, "Explain how a hash map handles collisions, with examples.")] * 2
    cost = dspark.get_cost_model("sps-table", profile=profile)
    return drafter, measure_draft_overhead(target, drafter, ids, args.requests, cost, calibrator, rounds=6)


# --------------------------------------------------------------------------------------------
# dspark bench
# --------------------------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser) -> None:
    from dspark.bench.run import BenchOptions
    from dspark.options import add_arguments

    p.description = (
        "Serve a workload at several concurrency levels with each scheduler (plain decoding, fixed k, "
        "threshold, sps-greedy, plugin schedulers) and report throughput, per-user rate, τ, ℓ̄, B and "
        "latency percentiles (JSON, Markdown, PNG); measured here and/or simulated from acceptance "
        "traces against a cost model (measured profile or an H200/H100 roofline). Re-running with the same inputs "
        "resumes (OUT/bench.provenance.json; other inputs over recorded runs are refused: --fresh redoes them)."
    )
    add_arguments(p, BenchOptions)
    p.add_argument("--replot", action="store_true", help="only redraw bench.png / bench.md from OUT/bench.json")


@command("bench", _bench_args, summary="benchmark schedulers under load, measured and simulated")
def _bench(args: argparse.Namespace) -> int:
    from dspark.bench.run import BenchOptions, replot_bench, run_bench

    if args.replot:
        png = replot_bench(args.out)
        emit(args, {"png": png, "markdown": png.with_name("bench.md")}, f"redrew {png} and bench.md")
        return 0
    bench = run_bench(BenchOptions.from_namespace(args))
    emit(args, bench.result, bench.markdown)
    log.info("wrote %s, bench.md, bench.png", bench.json_path)
    return 0
