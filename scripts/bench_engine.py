"""Engine round anatomy on the real SmolLM2-135M target: head share, engine overhead, verify curve.

    python scripts/bench_engine.py --out docs/reports/figures

Untrained (random-init) drafters: the compute is what is measured, not acceptance. Each run
queues chat prompts (``Engine.add_request`` with text: the target's chat template) on a fresh
``Engine(target, drafter, scheduler="full")``, greedy, and calls ``step()`` ``--rounds`` + 1
times — what ``generate`` does, minus running to completion: every request's token budget leaves
room for a full draft each round, so every round verifies 1 + γ tokens per request (a small
``max_new_tokens`` would clip the drafts to the remaining budget). The first round (which also
ingests the prompts' target features into the drafter's context cache) is not counted; the
requests are aborted afterwards. Per-round times come from ``engine.timings`` (``draft`` =
``drafter.draft``, of which ``sequential_head`` = sequential head + confidence head, ``target`` =
the verification forward, ``round`` = the whole ``step``); the drafter's per-position sampling
(softmax / greedy one-hot + the exponential race over V, part of ``draft``) is timed by wrapping
its ``_sample_block`` from the outside. One warm-up run per configuration, then ``--repeats``
runs; medians.

1. Sequential-head overhead: the ``dspark`` drafter (num_layers 5) with each head kind at
   ``--ranks`` (256 and 64), γ ∈ ``--gammas`` (7, 16), ``--head-concurrency`` (1, 8) requests.
2. Engine overhead: (round − target − draft) / round for dspark (gated-markov, r = 256), dflash,
   eagle3 and plain decoding (no drafter) at ``--engine-concurrency`` (1, 4, 16) requests.
3. The target's verification cost curve vs padded batch size: ``scripts/bench_target.py`` in a
   subprocess (same dtype and threads); its profile is embedded in the JSON.

Writes ``engine_bench.json`` and ``engine_overheads.png`` under ``--out`` and prints Markdown
tables; ``--replot`` redraws both from the JSON. Defaults to ONE torch thread: on a shared 2-core
machine a second OpenMP thread that gets descheduled makes a forward 10-60x slower (spin-waits),
which would swamp every ratio. The defaults (fp32) take about 8 minutes on the 2-core EPYC
(``--dtype bfloat16``: about 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import dspark
from dspark.engine import Engine
from dspark.heads import HEAD_KINDS
from dspark.profiling import cpu_name
from dspark.targets import load_target

# Prompts that ask for long answers, so that no request stops at EOS within the token budget
# (the batch keeps its concurrency for the whole run). Cycled when concurrency > len(PROMPTS).
PROMPTS = [
    "Write a detailed essay about the history of the printing press and its effect on Europe.",
    "Explain step by step how a hash map handles collisions, with examples.",
    "Describe, in several paragraphs, how photosynthesis works in plants.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Give a thorough comparison of Python, Rust and Go for writing web servers.",
    "Explain in detail how the TCP three-way handshake works and why it is needed.",
    "Write a detailed travel guide for a week in Kyoto, day by day.",
    "Describe the water cycle in detail for a high-school science class.",
]

PART_KEYS = ("round", "target", "draft", "sequential_head")


class _Spy:
    """Wraps one bound method of an object from the outside (shadowing it on the instance):
    sums its wall time and keeps each call's arguments' summary from ``note``."""

    def __init__(self, obj: Any, name: str, note: Any = None) -> None:
        self.seconds, self.notes = 0.0, []
        self._obj, self._name, self._note = obj, name, note
        self._inner = getattr(obj, name, None) if obj is not None else None
        if self._inner is not None:
            obj.__dict__[name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        if self._note is not None:
            self.notes.append(self._note(*args, **kwargs))
        return out

    def remove(self) -> None:
        if self._inner is not None:
            self._obj.__dict__.pop(self._name, None)


def _run_once(target: Any, drafter: Any, prompts: list[str], rounds: int, gamma: int) -> dict[str, Any]:
    """``rounds`` + 1 steps of a fresh engine over ``prompts`` → ms per round of each timed part.

    Every request gets a token budget that leaves room for a full γ-token draft in every measured
    round even if all drafts were accepted, so the ``full`` scheduler verifies 1 + γ tokens per
    request each round (``generate`` with a small ``max_new_tokens`` would clip the drafts to the
    remaining budget). The first round is not counted: it also ingests the prompts' target
    features into the drafter's context cache, a one-off prefill cost. The unfinished requests
    are aborted afterwards.
    """
    engine = Engine(target, drafter, scheduler="full")
    budget = (rounds + 2) * (gamma + 1) + 1
    for p in prompts:
        engine.add_request(p, max_new_tokens=budget)  # prefill, not timed
    sampling = _Spy(drafter, "_sample_block")  # the drafter's per-position sampling
    widths = _Spy(target, "verify", lambda ids, tokens, lengths: 1 + float(torch.as_tensor(lengths).float().mean()))
    sums = dict.fromkeys(PART_KEYS, 0.0)
    t_sampling, counted, stopped = 0.0, 0, 0
    try:
        for k in range(rounds + 1):
            before, s0, n0 = dict(engine.timings), sampling.seconds, engine.rounds
            outs = engine.step()
            stopped += sum(o.finished is not None for o in outs)
            if k == 0 or engine.rounds == n0:
                continue
            for key in PART_KEYS:
                sums[key] += engine.timings[key] - before[key]
            t_sampling += sampling.seconds - s0
            counted += 1
    finally:
        sampling.remove()
        widths.remove()
        engine.pop_finished()
        for rid in engine.active:
            engine.abort(rid)
    n = max(counted, 1)
    res: dict[str, Any] = {k: sums[k] / n * 1e3 for k in PART_KEYS}
    res["draft_sampling"] = t_sampling / n * 1e3
    res["rounds"] = counted
    res["mean_verified_width"] = statistics.fmean(widths.notes[1:]) if len(widths.notes) > 1 else 0.0
    res["stopped_early"] = stopped
    return res


def measure(target: Any, drafter: Any, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up once, then ``args.repeats`` runs; medians of per-round ms and of the shares."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    gamma = drafter.gamma if drafter is not None else 0
    if drafter is None:
        target.set_capture_layers(())  # plain decoding captures nothing
    _run_once(target, drafter, prompts, args.warmup_rounds, gamma)
    runs = [_run_once(target, drafter, prompts, args.rounds, gamma) for _ in range(args.repeats)]
    med = {f"{k}_ms": statistics.median(r[k] for r in runs) for k in PART_KEYS}
    med["draft_sampling_ms"] = statistics.median(r["draft_sampling"] for r in runs)
    med["other_ms"] = statistics.median(r["round"] - r["target"] - r["draft"] for r in runs)
    med["other_pct"] = statistics.median(100 * (r["round"] - r["target"] - r["draft"]) / r["round"] for r in runs)
    med["head_pct_of_round"] = statistics.median(100 * r["sequential_head"] / r["round"] for r in runs)
    med["head_pct_of_draft"] = statistics.median(
        100 * r["sequential_head"] / r["draft"] if r["draft"] else 0.0 for r in runs)
    med["mean_verified_width"] = statistics.median(r["mean_verified_width"] for r in runs)
    med["rounds"] = statistics.median(r["rounds"] for r in runs)
    med["stopped_early"] = max(r["stopped_early"] for r in runs)
    med["runs"] = runs
    return med


def _drafter(target: Any, kind: str, gamma: int, seed: int, **config: Any) -> Any:
    torch.manual_seed(seed)  # random init, reproducible
    return dspark.get_drafter(kind, target=target, gamma=gamma, **config)


def bench_heads(target: Any, dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for gamma in args.gammas:
        for head in HEAD_KINDS:
            for rank in args.ranks:
                drafter = _drafter(target, "dspark", gamma, args.seed, head=head, rank=rank,
                                   num_layers=args.num_layers)
                for conc in args.head_concurrency:
                    t0 = time.perf_counter()
                    m = measure(target, drafter, conc, args)
                    rows.append({"dtype": dtype, "head": head, "rank": rank, "gamma": gamma,
                                 "concurrency": conc, **m})
                    print(f"  [{time.perf_counter() - t0:5.1f}s] {dtype} {head} r={rank} γ={gamma} R={conc}: "
                          f"round {m['round_ms']:.1f} ms, head {m['sequential_head_ms']:.1f} ms "
                          f"({m['head_pct_of_round']:.1f} %)", flush=True)
                del drafter
                gc.collect()
    return rows


def bench_engine(target: Any, dtype: str, args: argparse.Namespace,
                 reuse: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    cases: list[tuple[str, int | None, dict[str, Any]]] = [("plain", None, {})]
    for gamma in args.gammas:
        cases += [("dspark", gamma, {"head": "gated-markov", "rank": 256, "num_layers": args.num_layers}),
                  ("dflash", gamma, {"num_layers": args.num_layers}),
                  ("eagle3", gamma, {})]
    for name, gamma, config in cases:
        drafter = None if name == "plain" else _drafter(target, name, gamma, args.seed, **config)
        for conc in args.engine_concurrency:
            # dspark gated-markov r=256 at this γ and R was already measured in part 1
            prior = [r for r in reuse if name == "dspark" and r["head"] == config.get("head")
                     and r["rank"] == config.get("rank") and r["gamma"] == gamma and r["concurrency"] == conc]
            t0 = time.perf_counter()
            m = {k: v for k, v in prior[0].items() if k not in ("dtype", "head", "rank", "gamma", "concurrency")} \
                if prior else measure(target, drafter, conc, args)
            rows.append({"dtype": dtype, "drafter": name, "gamma": gamma, "concurrency": conc,
                         "reused_from_part1": bool(prior), **m})
            print(f"  [{time.perf_counter() - t0:5.1f}s] {dtype} {name} γ={gamma} R={conc}: round "
                  f"{m['round_ms']:.1f} ms, target {m['target_ms']:.1f}, draft {m['draft_ms']:.1f}, "
                  f"other {m['other_ms']:.2f} ms ({m['other_pct']:.2f} %)", flush=True)
        del drafter
        gc.collect()
    return rows


def bench_verify_curve(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench_target.py in a subprocess; returns its profile and its printed tables."""
    script = Path(__file__).with_name("bench_target.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        cmd = [sys.executable, str(script), "--out", str(path), "--dtype", dtype,
               "--repeats", str(args.profile_repeats), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        profile = json.loads(path.read_text())
    tables = proc.stdout[proc.stdout.index("Verification step time"):].rsplit("\nwrote", 1)[0].strip()
    command = (f"python scripts/bench_target.py --out profile.json --dtype {dtype} "
               f"--repeats {args.profile_repeats} --threads {args.threads}")
    return {"command": command,
            "profile": profile, "markdown": tables}


# ------------------------------------------------------------------------------- reporting

def markdown_heads(rows: list[dict[str, Any]]) -> str:
    lines = ["| dtype | head | rank | γ | R | round ms | draft ms | head ms | head % of round | head % of draft |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['head']} | {r['rank']} | {r['gamma']} | {r['concurrency']} | "
                     f"{r['round_ms']:.1f} | {r['draft_ms']:.1f} | {r['sequential_head_ms']:.1f} | "
                     f"{r['head_pct_of_round']:.1f} % | {r['head_pct_of_draft']:.1f} % |")
    return "\n".join(lines)


def markdown_engine(rows: list[dict[str, Any]]) -> str:
    lines = ["| dtype | drafter | γ | R | 1+ℓ | round ms | target ms | draft ms | of which sampling ms "
             "| other ms | other % of round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = "–" if r["gamma"] is None else r["gamma"]
        lines.append(f"| {r['dtype']} | {r['drafter']} | {g} | {r['concurrency']} | "
                     f"{r['mean_verified_width']:.0f} | {r['round_ms']:.1f} | "
                     f"{r['target_ms']:.1f} | {r['draft_ms']:.1f} | {r['draft_sampling_ms']:.1f} | "
                     f"{r['other_ms']:.2f} | {r['other_pct']:.2f} % |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dtypes = results["meta"]["dtypes"]
    with_curve = bool(results.get("verification"))
    ncols = 3 if with_curve else 2
    fig = Figure(figsize=(5.2 * ncols, 4.2 * len(dtypes)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(dtypes), ncols, squeeze=False)
    for row, dtype in zip(axes, dtypes):
        # (a) head share of the round
        ax = row[0]
        heads = [r for r in results["head_overhead"] if r["dtype"] == dtype]
        groups = sorted({(r["head"], r["rank"]) for r in heads}, key=lambda k: (HEAD_KINDS.index(k[0]), -k[1]))
        series = sorted({(r["gamma"], r["concurrency"]) for r in heads})
        width = 0.8 / max(len(series), 1)
        for s, (gamma, conc) in enumerate(series):
            vals = [next((r["head_pct_of_round"] for r in heads if (r["head"], r["rank"]) == g
                          and (r["gamma"], r["concurrency"]) == (gamma, conc)), 0.0) for g in groups]
            ax.bar([i + (s - (len(series) - 1) / 2) * width for i in range(len(groups))], vals, width,
                   label=f"γ={gamma}, R={conc}")
        ax.axhspan(0.6, 1.3, color="grey", alpha=0.3, label="paper: 0.6–1.3 %")
        short = {"vanilla-markov": "vanilla", "gated-markov": "gated", "rnn": "rnn"}
        ax.set_xticks(range(len(groups)), [f"{short.get(h, h)}\nr={k}" for h, k in groups], fontsize=8)
        ax.set_ylim(0, 1.35 * max([r["head_pct_of_round"] for r in heads] + [1.3]))
        ax.set(ylabel="sequential + confidence head, % of round",
               title=f"(a) DSpark head share, SmolLM2 {dtype}")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
        # (b) engine overhead
        ax = row[1]
        eng = [r for r in results["engine_overhead"] if r["dtype"] == dtype]
        names = list(dict.fromkeys((r["drafter"], r["gamma"]) for r in eng))
        concs = sorted({r["concurrency"] for r in eng})
        width = 0.8 / max(len(concs), 1)
        for s, conc in enumerate(concs):
            vals = [next((r["other_pct"] for r in eng if (r["drafter"], r["gamma"]) == n
                          and r["concurrency"] == conc), 0.0) for n in names]
            ax.bar([i + (s - (len(concs) - 1) / 2) * width for i in range(len(names))], vals, width,
                   label=f"R={conc}")
        ax.axhline(5, color="red", lw=0.8, ls="--", label="goal ≤ 5 %")
        ax.set_xticks(range(len(names)), [n if g is None else f"{n}\nγ={g}" for n, g in names], fontsize=8)
        ax.set_ylim(0, 1.3 * max([r["other_pct"] for r in eng] + [5.0]))
        ax.set(ylabel="(round − target − draft) / round, %",
               title=f"(b) engine overhead, SmolLM2 {dtype}")
        ax.legend(fontsize=7, ncol=2, loc="upper right")
        # (c) verification cost curve
        if with_curve:
            ax = row[2]
            prof = results["verification"].get(dtype, {}).get("profile")
            if prof:
                pts = [(p["batch_size"], p["step_seconds"] * 1e3) for p in prof["points"]]
                ax.plot([b for b, _ in pts], [ms for _, ms in pts], marker="o")
                ax.set(xscale="log", xlabel="padded verification batch B = R·(1+ℓ)", ylabel="step ms",
                       title=f"(c) SmolLM2 {dtype} verification, {prof.get('threads')} thread(s)")
                ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/reports/figures")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--gammas", type=int, nargs="+", default=[7, 16])
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--head-concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--engine-concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3,
                    help="measured rounds per run (after one uncounted first round)")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="rounds of the warm-up run after its uncounted first round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--parts", nargs="+", default=["heads", "engine", "verify"],
                    choices=["heads", "engine", "verify"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replot", action="store_true",
                    help="measure nothing: redraw the PNG and reprint the tables from --out's JSON")
    args = ap.parse_args()
    if args.replot:
        out = Path(args.out)
        results = json.loads((out / "engine_bench.json").read_text())
        plot(results, out / "engine_overheads.png")
        report(results, out)
        return
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "device": f"{os.cpu_count()}-core {cpu_name()}", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
            "dtypes": args.dtype, "rounds": args.rounds, "repeats": args.repeats,
            "warmup_rounds": args.warmup_rounds, "scheduler": "full", "sampling": "greedy",
            "num_layers": args.num_layers, "prompts": PROMPTS,
            "loadavg_start": os.getloadavg(),
        },
        "head_overhead": [], "engine_overhead": [], "verification": {},
    }
    for dtype in args.dtype:
        print(f"== SmolLM2-135M {dtype}, {torch.get_num_threads()} thread(s)", flush=True)
        target = load_target("smollm2-135m", getattr(torch, dtype))
        heads = bench_heads(target, dtype, args) if "heads" in args.parts else []
        results["head_overhead"] += heads
        if "engine" in args.parts:
            results["engine_overhead"] += bench_engine(target, dtype, args, heads)
        del target
        gc.collect()
        if "verify" in args.parts:
            t0 = time.perf_counter()
            results["verification"][dtype] = bench_verify_curve(dtype, args)
            print(f"  [{time.perf_counter() - t0:5.1f}s] {dtype} verification curve", flush=True)
    results["meta"]["total_seconds"] = time.perf_counter() - t_start
    results["meta"]["loadavg_end"] = os.getloadavg()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bench.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    plot(results, out / "engine_overheads.png")

    report(results, out)


def report(results: dict[str, Any], out: Path) -> None:
    meta = results["meta"]
    print(f"\nSmolLM2-135M, {meta['device']}, torch {meta['torch']}, {meta['threads']} thread(s), "
          f"{meta['rounds']} rounds per run, median of {meta['repeats']} runs after a warm-up\n")
    if results["head_overhead"]:
        print("Sequential-head (+ confidence head) share of the round, dspark drafter:\n")
        print(markdown_heads(results["head_overhead"]) + "\n")
    if results["engine_overhead"]:
        print("Engine overhead (time outside the target forward and the drafter):\n")
        print(markdown_engine(results["engine_overhead"]) + "\n")
    for v in results["verification"].values():
        print(v["markdown"] + "\n")
    print(f"{out / 'engine_bench.json'}, {out / 'engine_overheads.png'}: measured in "
          f"{meta['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
