"""``dspark bench``: serve a workload at several concurrency levels with each scheduler, measured
on this machine and/or simulated from acceptance traces against a cost model.

The library function is :func:`run_bench` (a :class:`BenchOptions` in, a :class:`BenchResult`
out); :func:`replot_bench` redraws the report of a finished run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from attrs import field, frozen, validators

from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.options import (
    STEP_PATHS,
    NamespaceOptions,
    at_least,
    existing_device,
    ints,
    one_of,
    optional_ints,
    optional_path,
    path,
    resolve_options,
    strings,
)

__all__ = ["BenchOptions", "BenchResult", "build_engine", "default_schedulers", "replot_bench", "run_bench"]


def _levels(_inst: Any, a: Any, v: tuple[int, ...] | None) -> None:
    if v is not None and (not v or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in v)):
        raise ValueError(f"concurrency levels must be >= 1, got {list(v)}")


def _optional_strings(value: Any) -> tuple[str, ...] | None:
    return None if value is None else strings(value)


def _target_shape_name(_inst: Any, a: Any, v: str | None) -> None:
    if v is not None:
        from dspark.cost_models.roofline import target_shape

        target_shape(v)  # ValueError naming the known shapes


@frozen
class BenchOptions(NamespaceOptions):
    """What ``dspark bench`` serves and reports (defaults: the command line's; docs/cli.md explains
    each). ``schedulers`` None: plain, fixed:k=1, fixed:k=γ, threshold, sps-greedy; ``gate``
    None: sps-greedy gated (``("none",)``: no gate)."""

    out: str = field(default="out/bench", converter=path)
    model: str = field(default="smollm2-135m", converter=path)
    dtype: str = field(default="bfloat16", validator=one_of("float32", "bfloat16"))
    step: str = field(default="packed", validator=one_of(*STEP_PATHS))
    drafter: str = field(default=DEFAULT_DRAFTER, converter=path)
    calibration: str | None = field(default=None, converter=optional_path)
    prompts: str | None = field(default=None, converter=optional_path)
    per_domain: int = field(default=8, validator=at_least(1))
    concurrency: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64), converter=ints, validator=_levels)
    requests_per_level: int = field(default=0, validator=at_least(0))
    min_requests: int = field(default=8, validator=at_least(1))
    arrival: str = field(default="closed", validator=one_of("closed", "poisson"))
    rate: float | None = None
    schedulers: tuple[str, ...] | None = field(default=None, converter=_optional_strings)
    gate: tuple[str, ...] | None = field(default=None, converter=_optional_strings)
    gate_prior: str = field(default="measure", converter=path)
    max_new_tokens: int = field(default=64, validator=at_least(1))
    temperature: float = field(default=0.0, validator=at_least(0, integer=False))
    repeats: int = field(default=3, validator=at_least(1))
    interleave: bool = False
    profile: str | None = field(default=None, converter=optional_path)
    profile_context: int = field(default=0, validator=at_least(0))
    profile_repeats: int = field(default=5, validator=at_least(1))
    mode: str = field(default="measure", validator=one_of("measure", "simulate", "both"))
    traces: str | None = field(default=None, converter=optional_path)
    sim_cost_model: str = field(default="profile", validator=one_of("profile", "h200", "h100", "a100"))
    sim_params: float = field(default=135e6, validator=at_least(0, integer=False, strict=True))
    sim_target: str | None = field(default=None, validator=_target_shape_name)
    sim_launch_overhead_ms: float = field(default=0.0, validator=at_least(0, integer=False))
    sim_draft_fraction: float = field(default=1 / 30, validator=at_least(0, integer=False))
    sim_concurrency: tuple[int, ...] | None = field(default=None, converter=optional_ints, validator=_levels)
    time_model: str | None = field(default=None, converter=optional_path)
    threads: int | None = field(default=None, validator=validators.optional(at_least(1)))
    device: str = field(default="cpu", validator=existing_device)
    seed: int = 0
    fresh: bool = False
    quiet: bool = False

    def __attrs_post_init__(self) -> None:
        if self.arrival == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError("--arrival poisson needs --rate > 0 (requests per second)")
        if self.sim_target is not None and self.sim_cost_model == "profile":
            raise ValueError("--sim-target needs a roofline preset: --sim-cost-model h200, h100 or a100")


@frozen
class BenchResult:
    """What :func:`run_bench` wrote to ``out``: ``result`` is ``bench.json`` (meta, rows per
    scheduler × concurrency × measured/simulated, ratios, agreement, time model, runs) and
    ``markdown`` is ``bench.md``."""

    out: Path
    result: dict[str, Any]
    markdown: str

    @property
    def json_path(self) -> Path:
        return self.out / "bench.json"

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.result["rows"]


def default_schedulers(gamma: int) -> list[str]:
    return ["plain", "fixed:k=1", f"fixed:k={gamma}", "threshold", "sps-greedy"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def build_engine(target: Any, drafter: Any, spec: Any, cost_model: Any, calibrator: Any, gate: bool,
                 seed: int = 0, prior: Any = None) -> Any:
    """An engine for one benchmark entry; ``plain`` has no drafter (and captures no features);
    gated entries' draft gate starts from ``prior`` (a :class:`dspark.gating.GatePrior` or None)."""
    import dspark
    from dspark.engine import Engine
    from dspark.gating import DraftGate

    if spec.plain:
        return Engine(target, None, cost_model=cost_model, seed=seed)
    scheduler = dspark.get_scheduler(spec.name, **spec.config)
    return Engine(target, drafter, scheduler=scheduler, cost_model=cost_model, calibrator=calibrator or "identity",
                  draft_gate=DraftGate(prior=prior) if gate else None, seed=seed)


def _check_lossless(specs: list[Any]) -> None:
    from dspark.bench.runner import build_lossless

    for s in specs:
        if not s.plain:
            build_lossless(s, "the benchmark serves real requests")


def _requests_at(args: Any, c: int) -> int:
    return args.requests_per_level or max(2 * c, args.min_requests)


def _measure_profile(target: Any, args: Any, gamma: int, path: Path, context: int,
                     span: tuple[int, int] | None = None) -> Any:
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
    # The workload's requests verify over contexts from their prompt to prompt + max_new_tokens:
    # time the same shapes at both ends too, so the profile holds a curve and an α(R) per context
    # and the engine and the simulator read each round's step time at its own context.
    others = sorted({c for c in span or () if c != context and 0 < c < target.max_context - gamma - 2})
    if others:
        times.update(time_shapes(target, requests, widths, others,
                                 repeats=args.profile_repeats, progress=not args.quiet))
    profile = profile_from_shapes(times, model=args.model, dtype=args.dtype, device=device_name(target),
                                  repeats=args.profile_repeats, source="dspark bench")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    save_shapes(times, path.with_suffix(".shapes.json"))
    return profile


def _gate_prior(opts: Any, out: Path, gated: list[str], traces: Any, target: Any, drafter: Any,
                ids: list[Any], cost: Any, calibrator: Any) -> Any:
    """The gated entries' :class:`~dspark.gating.GatePrior`: ``--gate-prior measure`` (survival
    from the traces, overheads timed at each level, cached in OUT/gate_prior.json), a JSON path, or
    ``none``."""
    from dspark.gating import GatePrior

    if not gated or opts.gate_prior == "none":
        return None
    path = out / "gate_prior.json" if opts.gate_prior == "measure" else Path(opts.gate_prior)
    if path.is_file() and (opts.gate_prior != "measure" or not opts.fresh):
        try:
            return GatePrior.from_dict(json.loads(path.read_text()))
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"bad gate prior {path}: {e}") from None
    if opts.gate_prior != "measure":
        raise ValueError(f"--gate-prior: no such file {path} (give 'measure', 'none' or a JSON path)")
    from dspark.bench.prior import measure_draft_overhead
    from dspark.evaluation import save_json
    from dspark.interop import survival_from_rounds

    overhead = measure_draft_overhead(target, drafter, ids, [max(c, 1) for c in opts.concurrency], cost,
                                      calibrator, progress=not opts.quiet)
    prior = GatePrior(survival_from_rounds(traces()), overhead)
    save_json(prior.to_dict(), path)
    return prior


def _sim_cost_model(args: Any, measured: Any) -> tuple[Any, str]:
    import dspark

    if args.sim_cost_model == "profile":
        return measured, "the measured profile"
    overhead = args.sim_launch_overhead_ms / 1e3
    target = getattr(args, "sim_target", None)
    if target:  # the shape's parameters and KV bytes per token; --sim-params is ignored
        cm = dspark.get_cost_model("roofline", gpu=args.sim_cost_model, target=target,
                                   launch_overhead_s=overhead, accounting="packed")
        return cm, (f"roofline {args.sim_cost_model} for {target} ({cm.num_params:.3g} params, "
                    f"{cm.kv_bytes_per_token:.0f} KV bytes per token of context, each step reading "
                    f"R · context · KV bytes; --sim-params ignored; "
                    f"{args.sim_launch_overhead_ms} ms launch overhead, packed)")
    cm = dspark.get_cost_model("roofline", gpu=args.sim_cost_model, num_params=args.sim_params,
                               launch_overhead_s=overhead, accounting="packed")
    return cm, (f"roofline {args.sim_cost_model} ({args.sim_params:.3g} params, "
                f"{args.sim_launch_overhead_ms} ms launch overhead, packed)")


def replot_bench(out: str | Path) -> Path:
    """Redraw ``bench.png`` and ``bench.md`` of a finished run from ``out/bench.json`` (its ratios
    recomputed from the recorded runs, so an older file gets today's tables); the PNG's path."""
    from dspark.bench.report import bench_markdown, plot_bench, ratios, replica_ratios
    from dspark.evaluation import save_json

    out = Path(out)
    result = json.loads((out / "bench.json").read_text())
    result["ratios"] = ratios(result["rows"], summaries=result.get("runs", ()))
    result["replicas"] = replica_ratios(result.get("runs", ()))
    save_json(result, out / "bench.json")
    plot_bench(result["rows"], out / "bench.png", result["meta"]["title"])
    (out / "bench.md").write_text(bench_markdown(result))
    return out / "bench.png"


def run_bench(options: BenchOptions | None = None, /, **overrides: Any) -> BenchResult:
    """Serve a workload at each concurrency level with each scheduler, measured on this machine
    and/or simulated from acceptance traces, and report throughput, per-user rate, τ, ℓ̄, B and
    latency percentiles: ``bench.json``, ``bench.md``, ``bench.png`` (and ``interop/`` when
    simulating) in ``options.out``; recorded runs are reused unless ``fresh``. ``overrides``
    replace fields of ``options`` (or of the defaults)."""
    import torch
    from tqdm import tqdm

    import dspark
    from dspark.bench.records import LevelRun, summarise_run
    from dspark.bench.report import (
        aggregate,
        agreement,
        bench_markdown,
        plot_bench,
        ratios,
        replica_ratios,
    )
    from dspark.bench.runner import (
        parse_scheduler_specs,
        run_level,
        run_level_interleaved,
        run_order,
    )
    from dspark.bench.simulate import TimeModel, fit_time_model, simulate_level, traces_from_rounds
    from dspark.data.prompts import prompt_request
    from dspark.engine import encode_prompt
    from dspark.evaluation import Rounds, collect_rounds, save_json
    from dspark.evaluation_runs import eval_prompts, load_drafter_spec
    from dspark.gating import DraftGate
    from dspark.profiling import device_name
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    opts = resolve_options(BenchOptions, options, overrides)
    out = Path(opts.out)
    specs = parse_scheduler_specs(opts.schedulers or ())
    _check_lossless(specs)  # an unknown or lossy scheduler fails before the model loads
    if opts.threads:
        torch.set_num_threads(opts.threads)
    target = load_target(opts.model, getattr(torch, opts.dtype), device=opts.device, path=opts.step)
    label, drafter, calibrator = load_drafter_spec(opts.drafter, target)
    if opts.calibration:
        from dspark.calibration import load_calibrator

        calibrator = load_calibrator(opts.calibration)
    gamma = drafter.gamma
    if not specs:
        specs = parse_scheduler_specs(default_schedulers(gamma))
        _check_lossless(specs)
    gate = ["sps-greedy"] if opts.gate is None else [g for g in opts.gate if g != "none"]
    gated = [s.label for s in specs if not s.plain and (s.label in gate or s.name in gate)]
    prompts = eval_prompts(opts.prompts, opts.per_domain)
    ids = [encode_prompt(getattr(target, "tokenizer", None), prompt_request(p)) for p in prompts]
    sampling = SamplingParams.greedy() if opts.temperature == 0 else SamplingParams.random(opts.temperature)
    # Verification cost grows with the KV length (on this CPU a 64-request step costs 1.6× at 128
    # tokens of context than at 64): profile at the workload's mean context unless told otherwise.
    mean_prompt = sum(len(x) for x in ids) / len(ids)
    context = opts.profile_context or round(mean_prompt + opts.max_new_tokens / 2)
    profile = (dspark.cost_models.SPSProfile.from_json(opts.profile) if opts.profile
               else _measure_profile(target, opts, gamma, out / "profile.json", context,
                                     (round(mean_prompt), round(mean_prompt + opts.max_new_tokens))))
    cost = dspark.get_cost_model("sps-table", profile=profile)
    trace_path = Path(opts.traces) if opts.traces else out / "traces.json"
    rounds = None

    def traces_recorded() -> Any:  # rounds with every position verified, recorded once
        nonlocal rounds
        if rounds is None and trace_path.is_file():
            rounds = Rounds.from_dict(json.loads(trace_path.read_text()))
        elif rounds is None:
            rounds = collect_rounds(target, drafter, prompts, sampling, max_new_tokens=opts.max_new_tokens,
                                    concurrency=16, scheduler="full", seed=opts.seed, progress=not opts.quiet)
            save_json(rounds.to_dict(), trace_path)
        return rounds

    prior = (_gate_prior(opts, out, gated, traces_recorded, target, drafter, ids, cost, calibrator)
             if opts.mode != "simulate" else None)
    summaries, runs = [], []
    if opts.mode in ("measure", "both"):
        todo = [(rep, c, s) for rep in range(opts.repeats) for c in opts.concurrency for s in specs]
        bar = tqdm(total=sum(_requests_at(opts, c) for _, c, _ in todo), desc="bench (requests)", disable=opts.quiet)

        def engine_for(s: Any) -> Any:
            return build_engine(target, drafter, s, cost, calibrator, s.label in gated, opts.seed, prior)

        for rep in range(opts.repeats):
            for c in opts.concurrency:
                order = [specs[i] for i in run_order(len(specs), rep)]  # a Williams design
                paths = {s.label: out / "runs" / f"r{rep}-c{c}-{_slug(s.label)}.json" for s in order}
                n = _requests_at(opts, c)
                workload = dict(prompts=ids, concurrency=c, num_requests=n, sampling=sampling,
                                max_new_tokens=opts.max_new_tokens, arrival=opts.arrival, rate=opts.rate,
                                seed=opts.seed + rep, progress=bar)
                level: dict[str, Any] = {}
                if opts.interleave and (opts.fresh or not all(p.is_file() for p in paths.values())):
                    bar.set_postfix_str(f"c={c} interleaved")  # all of the level's runs again, side by side
                    level = run_level_interleaved({s.label: engine_for(s) for s in order}, **workload)
                    for label, run in level.items():
                        save_json(run.to_dict(), paths[label])
                for s in order:
                    path = paths[s.label]
                    if s.label in level:
                        run = level[s.label]
                    elif path.is_file() and not opts.fresh:  # resumable
                        run = LevelRun.from_dict(json.loads(path.read_text()))
                        bar.update(n)
                    else:
                        bar.set_postfix_str(f"c={c} {s.label}")
                        run = run_level(engine_for(s), label=s.label, **workload)
                        save_json(run.to_dict(), path)
                    runs.append(run)
                    summaries.append({**summarise_run(run), "repeat": rep})
        bar.close()
    sim_desc, time_model = None, None
    if opts.mode in ("simulate", "both"):
        traces = traces_from_rounds(traces_recorded(), opts.max_new_tokens, [len(x) for x in ids])
        sim_cost, sim_desc = _sim_cost_model(opts, cost)
        if runs and opts.sim_cost_model == "profile":
            time_model = fit_time_model(runs, cost)
        elif opts.time_model:
            time_model = TimeModel.from_dict(json.loads(Path(opts.time_model).read_text())["time_model"])
        else:
            time_model = TimeModel(draft_fraction=opts.sim_draft_fraction)
        levels = opts.sim_concurrency or opts.concurrency
        # the simulated gate's prior: the same survival, the overheads of the simulator's own time model
        sim_prior = None
        if gated and opts.gate_prior != "none":
            from dspark.gating import GatePrior
            from dspark.interop import survival_from_rounds

            sim_prior = GatePrior(survival_from_rounds(traces_recorded()), {
                R: max(time_model.draft_seconds(R, gamma, sim_cost) + time_model.overhead(R, True)
                       - time_model.overhead(R, False), 0.0) for R in levels})
        for c in levels:
            for s in (s for s in specs if not s.replica):  # a replica would replay the same rounds
                sched = None if s.plain else dspark.get_scheduler(s.name, **s.config)
                run = simulate_level(traces, s, scheduler=sched, calibrator=calibrator or dspark.get_calibrator("identity"),
                                     cost_model=sim_cost, time_model=time_model, concurrency=c,
                                     num_requests=_requests_at(opts, c), max_new_tokens=opts.max_new_tokens,
                                     arrival=opts.arrival, rate=opts.rate,
                                     draft_gate=DraftGate(prior=sim_prior) if s.label in gated else None,
                                     seed=opts.seed)
                summaries.append({**summarise_run(run), "repeat": 0})
    rows = aggregate(summaries)
    title = f"{opts.model} ({opts.dtype}), drafter {label}, " + (
        f"simulated: {sim_desc}" if opts.mode == "simulate" else device_name(target))
    meta = {"model": opts.model, "dtype": opts.dtype, "path": target.path, "device": device_name(target), "threads": torch.get_num_threads(),
            "drafter": label, "gamma": gamma, "calibrated": calibrator is not None, "arrival": opts.arrival,
            "rate": opts.rate, "max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature,
            "repeats": opts.repeats, "prompts": len(ids), "concurrency": opts.concurrency,
            "schedulers": [s.label for s in specs], "gated": gated,
            "gate_prior": prior.to_dict() if prior is not None else None,
            "cost_model": f"sps-table ({opts.profile or out / 'profile.json'})",
            "simulation_cost_model": sim_desc, "title": title,
            "command": " ".join(["dspark", *sys.argv[1:]])}
    result = {"meta": meta, "rows": rows, "ratios": ratios(rows, summaries=summaries),
              "replicas": replica_ratios(summaries), "agreement": agreement(rows),
              "time_model": time_model.to_dict() if time_model else None, "runs": summaries}
    if opts.mode in ("simulate", "both"):  # the same inputs, in the formats serving engines read
        from dspark.interop import survival_from_rounds, write_interop
        from dspark.profiling import load_shapes

        shapes_path = (Path(opts.profile) if opts.profile else out / "profile.json").with_suffix(".shapes.json")
        result["interop"] = write_interop(
            out / "interop", gamma=gamma, model=opts.drafter, calibrator=calibrator, profile=profile,
            shapes=load_shapes(shapes_path) if shapes_path.is_file() else None, survival=survival_from_rounds(rounds),
            draft_seconds=time_model.draft_seconds if runs else None, batch_sizes=opts.concurrency,
            context=context)
    save_json(result, out / "bench.json")
    markdown = bench_markdown(result)
    (out / "bench.md").write_text(markdown)
    plot_bench(rows, out / "bench.png", title)
    return BenchResult(out, result, markdown)
