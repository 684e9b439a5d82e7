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

from attrs import frozen, validators

from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.options import (
    DEVICE_HELP,
    STEP_HELP,
    STEP_PATHS,
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    existing_device,
    ints,
    option,
    optional_ints,
    optional_path,
    path,
    resolve_options,
    strings,
)

__all__ = ["BenchOptions", "BenchResult", "replot_bench", "run_bench"]


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
    each, :func:`dspark.options.option`). ``schedulers`` None: plain, fixed:k=1, fixed:k=γ, threshold, sps-greedy; ``gate``
    None: sps-greedy gated (``("none",)``: no gate)."""

    out: str = option("out/bench", converter=path,
                      help="folder: bench.json, bench.md, bench.png, profile.json, runs/")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    dtype: str = option("bfloat16", choices=("float32", "bfloat16"), help="the target's dtype")
    step: str = option("packed", choices=STEP_PATHS, help=STEP_HELP)
    drafter: str = option(DEFAULT_DRAFTER, converter=path, metavar="NAME|DIR",
                          help="[LABEL=]NAME|DIR: a shipped drafter's name or a checkpoint folder (its "
                          "calibration.json is used; NAME:vocab=K: cut to its K most frequent tokens, "
                          "docs/drafters-and-training.md)")
    calibration: str | None = option(None, converter=optional_path,
                                     help="calibrator JSON overriding the drafter's calibration.json")
    prompts: str | None = option(None, converter=optional_path,
                                 help="prompts JSONL {prompt, domain?} (default: the shipped held-out prompts)")
    per_domain: int = option(8, validator=at_least(1), help="prompts per domain (cycled over the requests)")
    concurrency: tuple[int, ...] = option((1, 2, 4, 8, 16, 32, 64), converter=ints, validator=_levels,
                                          help="levels, e.g. 1,4,16,64")
    requests_per_level: int = option(0, validator=at_least(0),
                                     help="requests per level (default: max(2c, --min-requests))")
    min_requests: int = option(8, validator=at_least(1), help="fewest requests a level serves")
    arrival: str = option("closed", choices=("closed", "poisson"),
                          help="closed loop of c users, or Poisson arrivals at --rate with at most c active")
    rate: float | None = option(None, help="requests per second (poisson)")
    schedulers: tuple[str, ...] | None = option(
        None, converter=_optional_strings, flag="--scheduler",
        help="NAME[:KEY=VALUE,...], repeatable, e.g. --scheduler fixed:k=1 --scheduler my-plugin; 'plain' is the "
        "no-drafter baseline (default: plain, fixed:k=1, fixed:k=γ, threshold, sps-greedy); an entry given twice "
        "runs twice (the second labelled NAME#2: an A/A control of the noise floor)")
    gate: tuple[str, ...] | None = option(
        None, converter=_optional_strings,
        help="scheduler entry run with the draft gate, repeatable (default: sps-greedy; 'none': no gate)")
    gate_prior: str = option("measure", converter=path,
                             help="what the draft gate assumes before it has measured: 'measure' (acceptance from the "
                             "traces, drafting overhead timed at each level; cached in OUT/gate_prior.json), a JSON "
                             "path, or 'none'")
    max_new_tokens: int = option(64, validator=at_least(1), help="tokens generated per request")
    temperature: float = option(0.0, validator=at_least(0, integer=False), help="sampling temperature (0: greedy)")
    repeats: int = option(3, validator=at_least(1),
                          help="measured repeats (medians reported, order balanced by a Williams design)")
    interleave: bool = option(False, help="run a level's schedulers side by side, one round of each in turn, each "
                              "timed on its own rounds only (a drift of the machine's speed lands on all alike; "
                              "sequential runs each see another minute)")
    profile: str | None = option(None, converter=optional_path,
                                 help="sps-table profile JSON (default: measured into OUT/profile.json)")
    profile_context: int = option(0, validator=at_least(0),
                                  help="KV length for the measured profile (default: the workload's mean prompt length "
                                  "+ half of --max-new-tokens, the mean context a request verifies over)")
    profile_repeats: int = option(5, validator=at_least(1), help="timed sweeps over the profile shapes (median kept)")
    mode: str = option("measure", choices=("measure", "simulate", "both"),
                       help="measure on this machine, simulate from traces, or both (with an agreement table)")
    traces: str | None = option(None, converter=optional_path,
                                help="acceptance traces: a rounds JSON from dspark eval (OUT/rounds/*.json) or calibrate "
                                "(default: recorded into OUT/traces.json with every position verified)")
    sim_cost_model: str = option("profile", choices=("profile", "h200", "h100", "a100"),
                                 help="simulation step times: the measured profile, or a GPU roofline preset")
    sim_params: float = option(135e6, validator=at_least(0, integer=False, strict=True),
                               help="target parameters for a roofline preset")
    sim_target: str | None = option(None, validator=_target_shape_name,
                                    help="roofline presets: a target shape (smollm2-135m, llama-3.1-8b, qwen3-8b, "
                                    "llama-3.1-70b) whose parameters and KV bytes per token set the step time, each step "
                                    "reading R · context · KV bytes (overrides --sim-params)")
    sim_launch_overhead_ms: float = option(0.0, validator=at_least(0, integer=False),
                                           help="per-step overhead for a roofline preset")
    sim_draft_fraction: float = option(1 / 30, validator=at_least(0, integer=False),
                                       help="roofline presets: drafting time as a fraction of a full block's "
                                       "verification step")
    sim_concurrency: tuple[int, ...] | None = option(None, converter=optional_ints, validator=_levels,
                                                     help="simulated levels (default: --concurrency)")
    time_model: str | None = option(None, converter=optional_path,
                                    help="bench.json of a measured run whose fitted time model to reuse")
    threads: int | None = option(None, validator=validators.optional(at_least(1)),
                                 help="torch threads (default: torch's)")
    device: str = option("cpu", validator=existing_device, help=DEVICE_HELP)
    seed: int = option(0, help="random seed")
    fresh: bool = option(False, help="redo runs already recorded under OUT")
    quiet: bool = False  # the global -q

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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _requests_at(args: Any, c: int) -> int:
    return args.requests_per_level or max(2 * c, args.min_requests)


#: what every result a bench records under OUT was computed from (runs/, profile.json, traces.json,
#: gate_prior.json): a re-run resumes only from the same inputs
PROVENANCE_NAME = "bench.provenance.json"


def _check_recorded(opts: BenchOptions, out: Path, prompts: list[Any]) -> None:
    """Refuse (:class:`~dspark.provenance.ProvenanceError`, one sentence naming the first input
    that differs) to resume from results recorded under ``out`` for other inputs, then record this
    run's. Each level's runs are files of their own (by repeat, concurrency and scheduler), so the
    levels and schedulers may change between runs; what every result depends on may not."""
    from dspark.evaluation.drafter_specs import check_drafter_spec
    from dspark.evaluation.inputs import prompt_keys_digest
    from dspark.provenance import check, files_digest, record

    def digest(path: str | None) -> str | None:
        return files_digest(path) if path and Path(path).is_file() else path

    provenance = {
        "model": opts.model, "dtype": opts.dtype, "step": opts.step, "device": opts.device, "threads": opts.threads,
        "drafter": opts.drafter, "checkpoint_digest": check_drafter_spec(opts.drafter),
        "calibration": digest(opts.calibration), "prompts": digest(opts.prompts) or "shipped",
        "prompt_keys": prompt_keys_digest(prompts), "max_new_tokens": opts.max_new_tokens,
        "temperature": opts.temperature, "arrival": opts.arrival, "rate": opts.rate, "seed": opts.seed,
        "requests_per_level": opts.requests_per_level, "min_requests": opts.min_requests,
        "profile": digest(opts.profile), "profile_context": opts.profile_context,
        "profile_repeats": opts.profile_repeats, "traces": digest(opts.traces), "gate_prior": digest(opts.gate_prior)}
    runs = out / "runs"
    recorded = (runs.is_dir() and any(runs.iterdir())) or any(
        (out / name).is_file() for name in ("profile.json", "traces.json", "gate_prior.json"))
    if recorded and not opts.fresh:
        check(out / PROVENANCE_NAME, provenance, f"the bench recorded in {out}",
              "pass --fresh to redo it, or choose another --out")
    record(out / PROVENANCE_NAME, provenance)


def replot_bench(out: str | Path) -> Path:
    """Redraw ``bench.png`` and ``bench.md`` of a finished run from ``out/bench.json`` (its ratios
    recomputed from the recorded runs, so an older file gets today's tables); the PNG's path."""
    from dspark.bench.report import bench_markdown, plot_bench, ratios, replica_ratios
    from dspark.evaluation.rounds import save_json

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
    from dspark.bench.costs import measure_profile, simulation_cost_model
    from dspark.bench.prior import bench_gate_prior
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
        build_engine,
        check_lossless,
        default_schedulers,
        parse_scheduler_specs,
        run_level,
        run_level_interleaved,
        run_order,
    )
    from dspark.bench.simulate import TimeModel, fit_time_model, simulate_level, traces_from_rounds
    from dspark.data.prompts import prompt_request
    from dspark.engine import encode_prompt
    from dspark.evaluation.drafter_specs import load_drafter_spec
    from dspark.evaluation.inputs import eval_prompts
    from dspark.evaluation.rounds import Rounds, collect_rounds, save_json
    from dspark.gating import DraftGate
    from dspark.profiling import device_name
    from dspark.targets import load_target
    from dspark.types import SamplingParams

    opts = resolve_options(BenchOptions, options, overrides)
    out = Path(opts.out)
    specs = parse_scheduler_specs(opts.schedulers or ())
    check_lossless(specs)  # an unknown or lossy scheduler fails before the model loads
    prompts = eval_prompts(opts.prompts, opts.per_domain)
    _check_recorded(opts, out, prompts)  # a resume from other inputs is refused before the model loads
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
        check_lossless(specs)
    gate = ["sps-greedy"] if opts.gate is None else [g for g in opts.gate if g != "none"]
    gated = [s.label for s in specs if not s.plain and (s.label in gate or s.name in gate)]
    ids = [encode_prompt(getattr(target, "tokenizer", None), prompt_request(p)) for p in prompts]
    sampling = SamplingParams.greedy() if opts.temperature == 0 else SamplingParams.random(opts.temperature)
    # Verification cost grows with the KV length: profile at the workload's mean context unless
    # told otherwise.
    mean_prompt = sum(len(x) for x in ids) / len(ids)
    context = opts.profile_context or round(mean_prompt + opts.max_new_tokens / 2)
    profile = (dspark.cost_models.SPSProfile.from_json(opts.profile) if opts.profile
               else measure_profile(target, opts, gamma, out / "profile.json", context,
                                     (round(mean_prompt), round(mean_prompt + opts.max_new_tokens))))
    cost = dspark.get_cost_model("sps-table", profile=profile)
    runner = None
    if getattr(target, "path", None) == "compiled" and opts.mode != "simulate":  # as dspark serve runs it
        from dspark.fast.drafter import choose_draft_runner

        runner = choose_draft_runner(target, drafter, ids[:2], cost, calibrator)  # logs its one line
    trace_path = Path(opts.traces) if opts.traces else out / "traces.json"
    rounds = None

    def traces_recorded() -> Any:  # rounds with every position verified, recorded once
        nonlocal rounds
        if rounds is None and trace_path.is_file() and (opts.traces or not opts.fresh):
            rounds = Rounds.from_dict(json.loads(trace_path.read_text()))
        elif rounds is None:
            rounds = collect_rounds(target, drafter, prompts, sampling, max_new_tokens=opts.max_new_tokens,
                                    concurrency=16, scheduler="full", seed=opts.seed, progress=not opts.quiet)
            save_json(rounds.to_dict(), trace_path)
        return rounds

    prior = (bench_gate_prior(opts, out, gated, traces_recorded, target, drafter, ids, cost, calibrator)
             if opts.mode != "simulate" else None)
    summaries, runs = [], []
    if opts.mode in ("measure", "both"):
        if getattr(target, "path", None) == "compiled":  # every shape class compiled before the first timed run
            from dspark.fast.warm import warm_up

            warm_up(target, drafter, ids[0], cost_model=cost)
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
                    for name, level_run in level.items():  # not `label`: that names the drafter
                        save_json(level_run.to_dict(), paths[name])
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
        sim_cost, sim_desc = simulation_cost_model(opts, cost)
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
            from dspark.gate_forecast import GatePrior
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
            "drafter": label, "draft_runner": runner.to_dict() if runner is not None else None, "gamma": gamma, "calibrated": calibrator is not None, "arrival": opts.arrival,
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
