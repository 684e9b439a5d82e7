"""``dspark bench``: serve a workload at several concurrency levels with each scheduler, measured
on this machine and/or simulated from acceptance traces against a cost model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_bench", "default_schedulers", "build_engine"]


def default_schedulers(gamma: int) -> list[str]:
    return ["plain", "fixed:k=1", f"fixed:k={gamma}", "threshold", "sps-greedy"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def build_engine(target: Any, drafter: Any, spec: Any, cost_model: Any, calibrator: Any, gate: bool,
                 seed: int = 0) -> Any:
    """An engine for one benchmark entry; ``plain`` has no drafter (and captures no features)."""
    import dspark
    from dspark.engine import Engine
    from dspark.gating import DraftGate

    if spec.plain:
        target.set_capture_layers(())
        return Engine(target, None, cost_model=cost_model, seed=seed)
    scheduler = dspark.get_scheduler(spec.name, **spec.config)
    return Engine(target, drafter, scheduler=scheduler, cost_model=cost_model, calibrator=calibrator or "identity",
                  draft_gate=DraftGate() if gate else None, seed=seed)


def _requests_at(args: Any, c: int) -> int:
    return args.requests_per_level or max(2 * c, args.min_requests)


def _measure_profile(target: Any, args: Any, gamma: int, path: Path, context: int) -> Any:
    from dspark.cost_models import SPSProfile
    from dspark.profiling import device_name, profile_from_shapes, save_shapes, time_shapes

    if path.is_file() and not args.fresh:
        return SPSProfile.from_json(path)
    widths = sorted({1, 2, 4, gamma + 1})
    # Powers of two up to the largest level as well: they link every R through shared B = R·(1+ℓ),
    # which the additive fit of α(R) + θ(B) needs.
    top = max(args.concurrency)
    requests = sorted(set(args.concurrency) | {1 << k for k in range(top.bit_length()) if 1 << k <= top})
    times = time_shapes(target, requests, widths, [context],
                        repeats=args.profile_repeats, progress=not args.quiet)
    profile = profile_from_shapes(times, model=args.model, dtype=args.dtype, device=device_name(target),
                                  repeats=args.profile_repeats, source="dspark bench")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    save_shapes(times, path.with_suffix(".shapes.json"))
    return profile


def _sim_cost_model(args: Any, measured: Any) -> tuple[Any, str]:
    import dspark

    if args.sim_cost_model == "profile":
        return measured, "the measured profile"
    cm = dspark.get_cost_model("roofline", gpu=args.sim_cost_model, num_params=args.sim_params,
                               launch_overhead_s=args.sim_launch_overhead_ms / 1e3, accounting="packed")
    return cm, (f"roofline {args.sim_cost_model} ({args.sim_params:.3g} params, "
                f"{args.sim_launch_overhead_ms} ms launch overhead, packed)")


def run_bench(args: Any) -> int:
    import torch
    from tqdm import tqdm

    import dspark
    from dspark.bench.records import LevelRun, summarise_run
    from dspark.bench.report import aggregate, agreement, bench_markdown, plot_bench, ratios
    from dspark.bench.runner import parse_scheduler_spec, run_level
    from dspark.bench.simulate import TimeModel, fit_time_model, simulate_level, traces_from_rounds
    from dspark.engine import encode_prompt
    from dspark.evaluation import Rounds, collect_rounds, save_json
    from dspark.evaluation_cli import eval_prompts, load_drafter_spec
    from dspark.gating import DraftGate
    from dspark.profiling import device_name
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    out = Path(args.out)
    if args.replot:
        result = json.loads((out / "bench.json").read_text())
        plot_bench(result["rows"], out / "bench.png", result["meta"]["title"])
        (out / "bench.md").write_text(bench_markdown(result))
        print(f"redrew {out / 'bench.png'} and bench.md", file=sys.stderr)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if any(c < 1 for c in args.concurrency):
        raise ValueError(f"concurrency levels must be >= 1, got {args.concurrency}")
    if args.arrival == "poisson" and not (args.rate and args.rate > 0):
        raise ValueError("--arrival poisson needs --rate > 0 (requests per second)")
    target = load_target(args.model, getattr(torch, args.dtype))
    label, drafter, calibrator = load_drafter_spec(args.drafter, target)
    if args.calibration:
        from dspark.calibration import load_calibrator

        calibrator = load_calibrator(args.calibration)
    gamma = drafter.gamma
    specs = [parse_scheduler_spec(s) for s in (args.schedulers or default_schedulers(gamma))]
    for s in specs:  # fail before any work on an unknown or lossy scheduler
        if not s.plain and not getattr(dspark.get_scheduler(s.name, **s.config), "lossless", False):
            raise ValueError(f"scheduler {s.label!r} is not lossless; the benchmark serves real requests")
    gate = ["sps-greedy"] if args.gate is None else [g for g in args.gate if g != "none"]
    gated = [s.label for s in specs if not s.plain and (s.label in gate or s.name in gate)]
    prompts = eval_prompts(args.prompts, args.per_domain)
    ids = [encode_prompt(getattr(target, "tokenizer", None), p.text) for p in prompts]
    sampling = SamplingParams.greedy() if args.temperature == 0 else SamplingParams.random(args.temperature)
    # Verification cost grows with the KV length (on this CPU a 64-request step costs 1.6× at 128
    # tokens of context than at 64): profile at the workload's mean context unless told otherwise.
    context = args.profile_context or round(sum(len(x) for x in ids) / len(ids) + args.max_new_tokens / 2)
    profile = (dspark.cost_models.SPSProfile.from_json(args.profile) if args.profile
               else _measure_profile(target, args, gamma, out / "profile.json", context))
    cost = dspark.get_cost_model("sps-table", profile=profile)
    summaries, runs = [], []
    if args.mode in ("measure", "both"):
        todo = [(rep, c, s) for rep in range(args.repeats) for c in args.concurrency for s in specs]
        bar = tqdm(total=sum(_requests_at(args, c) for _, c, _ in todo), desc="bench (requests)", disable=args.quiet)
        for rep in range(args.repeats):
            for c in args.concurrency:
                order = specs[rep % len(specs):] + specs[: rep % len(specs)]  # rotate: fair under drift
                for s in order:
                    path = out / "runs" / f"r{rep}-c{c}-{_slug(s.label)}.json"
                    n = _requests_at(args, c)
                    if path.is_file() and not args.fresh:  # resumable
                        run = LevelRun.from_dict(json.loads(path.read_text()))
                        bar.update(n)
                    else:
                        bar.set_postfix_str(f"c={c} {s.label}")
                        engine = build_engine(target, drafter, s, cost, calibrator, s.label in gated, args.seed)
                        run = run_level(engine, ids, label=s.label, concurrency=c, num_requests=n, sampling=sampling,
                                        max_new_tokens=args.max_new_tokens, arrival=args.arrival, rate=args.rate,
                                        seed=args.seed + rep, progress=bar)
                        save_json(run.to_dict(), path)
                    runs.append(run)
                    summaries.append({**summarise_run(run), "repeat": rep})
        bar.close()
    sim_desc, time_model = None, None
    if args.mode in ("simulate", "both"):
        trace_path = Path(args.traces) if args.traces else out / "traces.json"
        if trace_path.is_file():
            rounds = Rounds.from_dict(json.loads(trace_path.read_text()))
        else:
            rounds = collect_rounds(target, drafter, prompts, sampling, max_new_tokens=args.max_new_tokens,
                                    concurrency=16, scheduler="full", seed=args.seed, progress=not args.quiet)
            save_json(rounds.to_dict(), trace_path)
        traces = traces_from_rounds(rounds, args.max_new_tokens)
        sim_cost, sim_desc = _sim_cost_model(args, cost)
        if runs and args.sim_cost_model == "profile":
            time_model = fit_time_model(runs, cost)
        elif args.time_model:
            time_model = TimeModel.from_dict(json.loads(Path(args.time_model).read_text())["time_model"])
        else:
            time_model = TimeModel(draft_fraction=args.sim_draft_fraction)
        levels = args.sim_concurrency or args.concurrency
        for c in levels:
            for s in specs:
                sched = None if s.plain else dspark.get_scheduler(s.name, **s.config)
                run = simulate_level(traces, s, scheduler=sched, calibrator=calibrator or dspark.get_calibrator("identity"),
                                     cost_model=sim_cost, time_model=time_model, concurrency=c,
                                     num_requests=_requests_at(args, c), max_new_tokens=args.max_new_tokens,
                                     arrival=args.arrival, rate=args.rate,
                                     draft_gate=DraftGate() if s.label in gated else None, seed=args.seed)
                summaries.append({**summarise_run(run), "repeat": 0})
    rows = aggregate(summaries)
    title = f"{args.model} ({args.dtype}), drafter {label}, " + (
        f"simulated: {sim_desc}" if args.mode == "simulate" else device_name(target))
    meta = {"model": args.model, "dtype": args.dtype, "device": device_name(target), "threads": torch.get_num_threads(),
            "drafter": label, "gamma": gamma, "calibrated": calibrator is not None, "arrival": args.arrival,
            "rate": args.rate, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "repeats": args.repeats, "prompts": len(ids), "concurrency": args.concurrency,
            "schedulers": [s.label for s in specs], "gated": gated,
            "cost_model": f"sps-table ({args.profile or out / 'profile.json'})",
            "simulation_cost_model": sim_desc, "title": title,
            "command": " ".join(["dspark", *sys.argv[1:]])}
    result = {"meta": meta, "rows": rows, "ratios": ratios(rows), "agreement": agreement(rows),
              "time_model": time_model.to_dict() if time_model else None, "runs": summaries}
    if args.mode in ("simulate", "both"):  # the same inputs, in the formats serving engines read
        from dspark.interop import survival_from_rounds, write_interop
        from dspark.profiling import load_shapes

        shapes_path = (Path(args.profile) if args.profile else out / "profile.json").with_suffix(".shapes.json")
        result["interop"] = write_interop(
            out / "interop", gamma=gamma, model=args.drafter, calibrator=calibrator, profile=profile,
            shapes=load_shapes(shapes_path) if shapes_path.is_file() else None, survival=survival_from_rounds(rounds),
            draft_seconds=time_model.draft_seconds if runs else None, batch_sizes=args.concurrency)
    save_json(result, out / "bench.json")
    (out / "bench.md").write_text(bench_markdown(result))
    plot_bench(rows, out / "bench.png", title)
    print(bench_markdown(result))
    print(f"wrote {out / 'bench.json'}, bench.md, bench.png", file=sys.stderr)
    return 0
