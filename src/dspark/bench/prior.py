"""The draft gate's prior for a benchmark: what drafting costs and wins on this machine and workload
before any gated round ran (:class:`dspark.gate_forecast.GatePrior`).

* survival s_j = P(accepted ≥ j): from rounds recorded with every position verified (the same
  traces the simulator replays and ``dspark interop`` turns into vLLM / TensorRT-LLM tables);
* draft overhead at each concurrency R: rounds drafting γ and plain ones on R real requests, each
  round's seconds less the cost model's step time t(B) + α(R) at its context; the overhead is the
  drafted rounds' median less the plain rounds' (the first round of each pass, which ingests the
  prompts, is left out). The passes alternate (plain, drafted, plain, drafted, …) so that a shared
  machine's drift reaches both sides (one short pass each can under-measure the overhead many
  times over on a machine whose speed wanders). Each round is taken on the cost model's clock, as
  the gate takes its own rounds (``DraftGate.speed_normalised``): its seconds divided by φ = its
  verification step's seconds / the model's t(B) + α(R). The overhead is then in the profile's seconds, the unit of the
  forecast's t(B), even when the machine ran at another speed while the profile was taken (a
  wall-clock overhead read against a profile taken at another speed can forecast a loss where
  drafting pays).

A serving engine's operator would time these once per deployment, as for the TensorRT-LLM table.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["bench_gate_prior", "measure_draft_overhead"]


def _round_excess(engine: Any, ids: Sequence[Any], num_requests: int, rounds: int, cost_model_at: Any) -> list[float]:
    """Seconds beyond the cost model's t(B) + α(R) (a plain round: its plain step, as the draft
    gate reads it) of rounds 2..``rounds`` of R requests, on the cost model's clock (each round's
    seconds / φ, φ = its verification seconds / the modelled step)."""
    from dspark.cost_models import plain_step_seconds, round_seconds
    from dspark.gate_forecast import speed_factor
    from dspark.types import SamplingParams

    for i in range(num_requests):
        engine.add_request(ids[i % len(ids)], SamplingParams.greedy(), max_new_tokens=rounds * 8 + 8,
                           request_id=f"prior-{i}")
    out = []
    for k in range(rounds):
        engine.step()
        info = engine.last_round
        if k and info.num_requests == num_requests:
            cm = cost_model_at(info.context, info.num_requests)
            modelled = (round_seconds(cm, info.batch_size, info.num_requests) if info.drafted
                        else plain_step_seconds(cm, info.num_requests))
            out.append(info.seconds / speed_factor(info.target_seconds, modelled) - modelled)
    for rid in list(engine.active):
        engine.abort(rid)
    engine.pop_finished()
    return out


def measure_draft_overhead(target: Any, drafter: Any, ids: Sequence[Any], num_requests: Sequence[int],
                           cost_model: Any, calibrator: Any = None, rounds: int = 4,
                           progress: bool = False, passes: int = 3, clock: Any = None) -> dict[int, float]:
    """{R: seconds} a round drafting γ for R requests spends beyond a plain round, besides the
    verification of its drafts, on the cost model's clock (module docstring): ``passes``
    alternating pairs of a plain and a drafted pass of ``rounds`` rounds each. ``clock``: the
    engines' clock (tests; default ``time.perf_counter``)."""
    import dspark
    from dspark.cost_models.context import ContextBinding
    from dspark.engine import Engine

    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the first one ingests the prompts), got {rounds}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    at = ContextBinding(cost_model)
    timed = {} if clock is None else {"clock": clock}  # the engines' default clock otherwise
    out = {}
    for R in sorted(set(num_requests)):
        if progress:
            print(f"gate prior: timing R = {R}", flush=True)
        fixed = dspark.get_scheduler("fixed", k=drafter.gamma)
        plain, drafted = [], []
        for _ in range(passes):
            plain += _round_excess(Engine(target, None, cost_model=cost_model, **timed), ids, R, rounds, at)
            drafted += _round_excess(Engine(target, drafter, scheduler=fixed, cost_model=cost_model,
                                            calibrator=calibrator or "identity", **timed), ids, R, rounds, at)
        if plain and drafted:
            out[R] = max(statistics.median(drafted) - statistics.median(plain), 0.0)
    return out


def bench_gate_prior(opts: Any, out: Path, gated: list[str], traces: Any, target: Any, drafter: Any,
                     ids: list[Any], cost: Any, calibrator: Any) -> Any:
    """The gated entries' :class:`~dspark.gate_forecast.GatePrior`: ``--gate-prior measure`` (survival
    from the traces, overheads timed at each level, cached in OUT/gate_prior.json), a JSON path, or
    ``none``."""
    from dspark.gate_forecast import GatePrior

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
    from dspark.evaluation.rounds import save_json
    from dspark.interop import survival_from_rounds

    overhead = measure_draft_overhead(target, drafter, ids, [max(c, 1) for c in opts.concurrency], cost,
                                      calibrator, progress=not opts.quiet)
    prior = GatePrior(survival_from_rounds(traces()), overhead)
    save_json(prior.to_dict(), path)
    return prior
