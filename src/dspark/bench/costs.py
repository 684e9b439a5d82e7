"""The cost models of a benchmark: the measured ``sps-table`` profile the engines schedule with,
and the one the simulator replays traces against (the measured profile or a roofline preset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["measure_profile", "simulation_cost_model"]


def measure_profile(target: Any, args: Any, gamma: int, path: Path, context: int,
                     span: tuple[int, int] | None = None) -> Any:
    """The ``sps-table`` profile at ``path`` (reused unless ``args.fresh``), else timed on ``target``
    at ``context`` tokens (and at the ``span`` of contexts the workload decodes over) and saved
    there with its shapes."""
    from dspark.cost_models import SPSProfile
    from dspark.profiling import device_name, profile_from_shapes, save_shapes, time_profile

    if path.is_file() and not args.fresh:
        return SPSProfile.from_json(path)
    widths = sorted({1, 2, 4, gamma + 1})
    # Powers of two up to the largest level as well: they link every R through shared B = R·(1+ℓ),
    # which the additive fit of α(R) + θ(B) needs.
    top = max(args.concurrency)
    requests = sorted(set(args.concurrency) | {1 << k for k in range(top.bit_length()) if 1 << k <= top})
    # The workload's requests verify over contexts from their prompt to prompt + max_new_tokens:
    # time the same shapes at both ends too, so the profile holds a curve and an α(R) per context
    # and the engine and the simulator read each round's step time at its own context. The main
    # context is timed first: the profile's points are the first context's.
    others = sorted({c for c in span or () if c != context and 0 < c < target.max_context - gamma - 2})
    times, plain = time_profile(target, requests, widths, [context, *others],
                                repeats=args.profile_repeats, progress=not args.quiet)
    profile = profile_from_shapes(times, model=args.model, dtype=args.dtype, device=device_name(target),
                                  repeats=args.profile_repeats, source="dspark bench", plain=plain)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    save_shapes(times, path.with_suffix(".shapes.json"))
    return profile


def simulation_cost_model(args: Any, measured: Any) -> tuple[Any, str]:
    """The cost model the simulator prices rounds with (``args.sim_cost_model``: the ``measured``
    profile or a roofline preset) and a description of it for the report."""
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
