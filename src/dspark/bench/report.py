"""Aggregating benchmark runs (median over repeats) and writing them: JSON, Markdown, PNG."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["aggregate", "ratios", "replica_ratios", "pooled_ratio", "bench_markdown", "plot_bench", "METRICS"]

METRICS = ("throughput_tok_s", "per_user_tok_s", "tau", "mean_verified", "mean_batch", "mean_active",
           "drafted_fraction", "step_ms", "draft_ms", "latency_p50_s", "latency_p90_s", "latency_p99_s",
           "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms")


def _median(values: list[float]) -> float:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(xs) if xs else math.nan


def aggregate(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scheduler, concurrency, simulated): the median of every metric over repeats, plus the
    spread of throughput (min, max) so a reader sees the noise."""
    groups: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault((s["scheduler"], s["concurrency"], s.get("simulated", False)), []).append(s)
    out = []
    for (sched, c, sim), rows in groups.items():
        row = {"scheduler": sched, "concurrency": c, "simulated": sim, "repeats": len(rows)}
        for m in METRICS:
            row[m] = _median([r[m] for r in rows])
        tp = [r["throughput_tok_s"] for r in rows]
        row["throughput_min"], row["throughput_max"] = min(tp), max(tp)
        out.append(row)
    return sorted(out, key=lambda r: (r["simulated"], r["concurrency"], r["scheduler"]))


def _family(label: str) -> str:
    """A scheduler label's registered name: ``sps-greedy:sunk=true`` → ``sps-greedy``."""
    return label.split(":", 1)[0]


def _is_replica(label: str) -> bool:
    from dspark.bench.runner import replica_of

    return replica_of(label) is not None


def _paired(summaries: Sequence[dict[str, Any]], c: int, focus: str, baseline: str) -> tuple[float, float]:
    """Measured repeats at concurrency c: the median over repeats of ``focus`` / ``baseline`` and of
    ``focus`` / the best other scheduler *of the same repeat* (``focus``'s own variants left out).
    Runs of one repeat are close in time, so the slow drift of a shared machine's speed cancels in
    these ratios (not in ratios of medians)."""
    reps: dict[int, dict[str, float]] = {}
    for s in summaries:
        if s["concurrency"] == c and not s.get("simulated", False):
            reps.setdefault(s.get("repeat", 0), {})[s["scheduler"]] = s["throughput_tok_s"]
    vs_plain, vs_best = [], []
    for at in reps.values():
        if focus not in at:
            continue
        if baseline in at:
            vs_plain.append(at[focus] / at[baseline])
        others = [v for k, v in at.items() if _family(k) != _family(focus) and not _is_replica(k)]
        if others:
            vs_best.append(at[focus] / max(others))
    return _median(vs_plain) if vs_plain else math.nan, _median(vs_best) if vs_best else math.nan


def ratios(rows: Sequence[dict[str, Any]], focus: str = "sps-greedy", baseline: str = "plain",
           summaries: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Per concurrency and per scheduler of ``focus``'s family (``focus`` and its variants, e.g.
    ``sps-greedy:sunk=true``): its throughput / ``baseline``'s and / the best scheduler of another
    family (ratios of the medians; a variant is not the competition its family must beat), and with
    ``summaries`` (every repeat) the medians of the per-repeat ratios. Replicas (``plain#2``) are
    neither focus nor competition: :func:`replica_ratios` reports them."""
    out = []
    for sim in sorted({r["simulated"] for r in rows}):
        for c in sorted({r["concurrency"] for r in rows if r["simulated"] == sim}):
            at = {r["scheduler"]: r["throughput_tok_s"] for r in rows if r["concurrency"] == c and r["simulated"] == sim}
            others = {k: v for k, v in at.items() if _family(k) != _family(focus) and not _is_replica(k)}
            best = max(others, key=others.get) if others else None
            for name in sorted(k for k in at if _family(k) == _family(focus) and not _is_replica(k)):
                out.append({"concurrency": c, "simulated": sim, "focus": name,
                            "vs_plain": at[name] / at[baseline] if baseline in at else math.nan,
                            "best_other": best, "vs_best_other": at[name] / others[best] if best else math.nan})
                if not sim and summaries:
                    out[-1]["vs_plain_paired"], out[-1]["vs_best_other_paired"] = _paired(summaries, c, name, baseline)
    return out


def replica_ratios(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency and replica (``plain#2``): the replica's throughput / its original's in each
    measured repeat — the same scheduler twice, so their spread is the noise floor of every paired
    ratio in the same run (median, min and max over repeats)."""
    from dspark.bench.runner import replica_of

    reps: dict[tuple[int, int], dict[str, float]] = {}
    for s in summaries:
        if not s.get("simulated", False):
            reps.setdefault((s["concurrency"], s.get("repeat", 0)), {})[s["scheduler"]] = s["throughput_tok_s"]
    pairs: dict[tuple[int, str], list[float]] = {}
    for (c, _), at in sorted(reps.items()):
        for label, v in at.items():
            original = replica_of(label)
            if original is not None and at.get(original):
                pairs.setdefault((c, label), []).append(v / at[original])
    return [{"concurrency": c, "replica": label, "original": replica_of(label), "ratios": xs,
             "median": _median(xs), "min": min(xs), "max": max(xs)} for (c, label), xs in sorted(pairs.items())]


def pooled_ratio(summaries: Sequence[dict[str, Any]], a: str, b: str, levels: Sequence[int] | None = None,
                 resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """``a`` / ``b`` pooled over the measured (level, repeat) pairs at ``levels`` (default: every
    level both ran): the geometric mean of the per-pair throughput ratios and a bootstrap 95 %
    interval over pairs (``resamples`` resamples with replacement, ``seed``: the same interval on
    every call). Pairs are runs of one repeat at one level, so a machine's drift cancels in each."""
    import numpy as np

    at: dict[tuple[int, int], dict[str, float]] = {}
    for s in summaries:
        if not s.get("simulated", False) and (levels is None or s["concurrency"] in levels):
            at.setdefault((s["concurrency"], s.get("repeat", 0)), {})[s["scheduler"]] = s["throughput_tok_s"]
    logs = np.array([math.log(v[a] / v[b]) for _, v in sorted(at.items()) if v.get(a) and v.get(b)])  # [pairs]
    if not len(logs):
        raise ValueError(f"no measured repeat ran both {a!r} and {b!r}" + (f" at levels {list(levels)}" if levels else ""))
    means = np.random.default_rng(seed).choice(logs, size=(resamples, len(logs))).mean(axis=1)  # [resamples]
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {"a": a, "b": b, "pairs": len(logs), "geomean": math.exp(logs.mean()), "low": math.exp(lo),
            "high": math.exp(hi)}


def _f(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def bench_markdown(result: dict[str, Any]) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [f"# dspark bench: {meta['model']} ({meta['dtype']}) on {meta['device']}", "",
             f"Command: `{meta['command']}`", "",
             f"Drafter {meta['drafter']} (γ = {meta['gamma']}"
             + (f", {meta['draft_runner']['runner']} runner" if meta.get("draft_runner") else "")
             + f"), {meta['arrival']} arrivals"
             + (f" at {meta['rate']} req/s" if meta.get("rate") else "")
             + f", {meta['max_new_tokens']} max new tokens, temperature {meta['temperature']}, "
             f"median of {meta['repeats']} measured repeat(s); cost model: {meta['cost_model']}. "
             f"Draft gate on: {', '.join(meta['gated']) or 'none'}."
             + (f" Simulation: step times from {meta['simulation_cost_model']}, acceptance replayed from "
                "traces recorded with every position verified." if meta.get("simulation_cost_model") else ""),
             ""]
    for sim in (False, True):
        sub = [r for r in rows if r["simulated"] == sim]
        if not sub:
            continue
        lines += [f"## {'Simulated' if sim else 'Measured'}", "",
                  "| c | scheduler | tok/s | (min–max) | tok/s/user | τ | ℓ̄ | B̄ | drafted | step ms "
                  "| p50 latency s | p99 latency s | TTFT p50 s | TPOT p50 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            lines.append(
                f"| {r['concurrency']} | {r['scheduler']} | {_f(r['throughput_tok_s'], 1)} | "
                f"{_f(r['throughput_min'], 1)}–{_f(r['throughput_max'], 1)} | {_f(r['per_user_tok_s'], 1)} | "
                f"{_f(r['tau'])} | {_f(r['mean_verified'])} | {_f(r['mean_batch'], 1)} | "
                f"{_f(r['drafted_fraction'])} | {_f(r['step_ms'], 1)} | {_f(r['latency_p50_s'])} | "
                f"{_f(r['latency_p99_s'])} | {_f(r['ttft_p50_s'])} | {_f(r['tpot_p50_ms'], 1)} |")
        lines.append("")
    if result.get("ratios"):
        lines += ["## Throughput ratios", "",
                  "Ratios of the medians; *paired*: the median over repeats of each repeat's own ratio (runs "
                  "of one repeat are close in time, so a shared machine's drift cancels). *Best other*: the "
                  "fastest scheduler outside the scheduler's own family (its variants left out).", "",
                  "| c | measured/simulated | scheduler | / plain | best other | / best other | "
                  "paired / plain | paired / best other |", "|---|---|---|---|---|---|---|---|"]
        for q in result["ratios"]:
            lines.append(f"| {q['concurrency']} | {'simulated' if q['simulated'] else 'measured'} | "
                         f"{q['focus']} | "
                         f"{_f(q['vs_plain'], 3)} | {q['best_other']} | {_f(q['vs_best_other'], 3)} | "
                         f"{_f(q.get('vs_plain_paired', math.nan), 3)} | {_f(q.get('vs_best_other_paired', math.nan), 3)} |")
        lines.append("")
    if result.get("replicas"):
        lines += ["## A/A: the same scheduler run twice", "",
                  "Each replica's throughput / its original's in the same repeat: what a paired ratio between two "
                  "identical schedulers reads on this machine (the noise floor of the ratios above).", "",
                  "| c | replica / original | paired (median) | min | max |", "|---|---|---|---|---|"]
        for q in result["replicas"]:
            lines.append(f"| {q['concurrency']} | {q['replica']} / {q['original']} | {_f(q['median'], 3)} | "
                         f"{_f(q['min'], 3)} | {_f(q['max'], 3)} |")
        lines.append("")
        for replica, original in dict.fromkeys((q["replica"], q["original"]) for q in result["replicas"]):
            if result.get("runs"):
                p = pooled_ratio(result["runs"], replica, original)
                lines += [f"Pooled over every level: {replica} / {original} = {p['geomean']:.4f}, 95 % bootstrap "
                          f"interval [{p['low']:.4f}, {p['high']:.4f}] ({p['pairs']} pairs; "
                          "`python scripts/bench_pooled.py OUT A B --levels ...` pools any two entries).", ""]
    if result.get("agreement"):
        lines += ["## Simulation vs measurement (same profile, fitted drafting/overhead times)", "",
                  "| c | scheduler | measured tok/s | simulated tok/s | simulated / measured |", "|---|---|---|---|---|"]
        for a in result["agreement"]:
            lines.append(f"| {a['concurrency']} | {a['scheduler']} | {_f(a['measured'], 1)} | "
                         f"{_f(a['simulated'], 1)} | {_f(a['ratio'], 3)} |")
        lines.append("")
    return "\n".join(lines)


def agreement(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Simulated vs measured throughput for every (scheduler, concurrency) that has both."""
    measured = {(r["scheduler"], r["concurrency"]): r["throughput_tok_s"] for r in rows if not r["simulated"]}
    out = []
    for r in rows:
        key = (r["scheduler"], r["concurrency"])
        if r["simulated"] and key in measured:
            out.append({"scheduler": key[0], "concurrency": key[1], "measured": measured[key],
                        "simulated": r["throughput_tok_s"], "ratio": r["throughput_tok_s"] / measured[key]})
    return out


def plot_bench(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels in the style of the paper's serving figures: throughput vs per-user rate (one
    line per scheduler, points labelled by concurrency) and ℓ̄ vs concurrency; simulated dashed."""
    from dspark.plotting import _require_matplotlib

    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(17, 5))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    scheds = list(dict.fromkeys(r["scheduler"] for r in rows))
    colors = {s: f"C{i}" for i, s in enumerate(scheds)}
    for sim in (False, True):
        for s in scheds:
            sub = sorted((r for r in rows if r["scheduler"] == s and r["simulated"] == sim),
                         key=lambda r: r["concurrency"])
            if not sub:
                continue
            style = dict(color=colors[s], linestyle="--" if sim else "-", marker="x" if sim else "o",
                         label=f"{s}{' (sim)' if sim else ''}")
            ax1.plot([r["per_user_tok_s"] for r in sub], [r["throughput_tok_s"] for r in sub], **style)
            if not sim:
                for r in sub:
                    ax1.annotate(str(r["concurrency"]), (r["per_user_tok_s"], r["throughput_tok_s"]),
                                 fontsize=7, xytext=(3, 3), textcoords="offset points")
            cs = [r["concurrency"] for r in sub]
            ax2.plot(cs, [r["mean_verified"] for r in sub], **style)
            plain = {r["concurrency"]: r["throughput_tok_s"] for r in rows
                     if r["scheduler"] == "plain" and r["simulated"] == sim}
            if plain:
                ax3.plot(cs, [r["throughput_tok_s"] / plain.get(r["concurrency"], math.nan) for r in sub], **style)
    ax1.set(xlabel="per-user rate (tok/s/user)", ylabel="aggregate throughput (tok/s)", title="throughput vs per-user rate")
    ax2.set(xlabel="concurrency", ylabel="mean verified length ℓ̄", xscale="log", title="ℓ̄ vs concurrency")
    ax3.set(xlabel="concurrency", ylabel="throughput / plain", xscale="log", title="throughput vs plain decoding")
    ax3.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
