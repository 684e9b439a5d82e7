"""Training throughput, eager against ``torch.compile`` (``dspark train --compile``): anchors per second.

    python scripts/train_throughput.py --out out/train_throughput --repeats 3 --steps 10

What ``dspark train`` builds for the embedded SmolLM2-135M target with scripts/train_smollm2.sh's
settings (1 draft layer, γ = 7, a 4,096-token draft vocabulary, DSpark's gated-Markov head of rank
128, lr 1e-3, ``--seqs-per-step`` sequences × ``--anchors-per-seq`` anchors a step) on the first
sequences of the shipped self-distillation data (``data/smollm2-135m/templated.tar.xz``), with the
default full-vocabulary teacher read from a feature cache (built once under OUT/data).

A run is a fresh drafter (same seed) trained ``--warmup`` + ``--steps`` optimizer steps, eager or
compiled; the two alternate (eager, compiled, eager, compiled, ...) ``--repeats`` times, each
compiled run compiling afresh (dynamo's cache emptied; inductor's on-disk cache may shorten the
later compiles). anchors/s = seqs_per_step × anchors_per_seq × steps ÷ the seconds of the timed
steps: the first step (where the compiled run compiles) and the warm-up steps are excluded and the
first step is reported on its own. Every step draws new sequences (about (1 + warmup + steps) ×
seqs_per_step of them), so batch lengths vary as in training. Writes OUT/train_throughput.json and
OUT/train_throughput.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "smollm2-135m" / "templated.tar.xz"
MODES = ("eager", "compiled")


def training_data(out: Path, n: int) -> Path:
    """OUT/data/train.jsonl: the first ``n`` records of the shipped templated data."""
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(SHIPPED) as tar:
        member = next(m for m in tar.getmembers() if Path(m.name).name == "train.jsonl")
        lines = tar.extractfile(member).read().decode().splitlines()[:n]
    text = "\n".join(lines) + "\n"
    path = folder / "train.jsonl"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return folder


def drafter_config(kind: str, model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The drafter for ``kind``: scripts/train_smollm2.sh's by default, the paper configuration's
    (scripts/train_paper_config.sh) with ``--num-layers 5 --draft-vocab 0 --head vanilla-markov``;
    the head only where the kind has one."""
    from dspark.drafters.kinds import drafter_kind

    config: dict[str, Any] = {"gamma": 7, "num_layers": args.num_layers}
    if args.draft_vocab:
        config["draft_vocab_size"] = args.draft_vocab + 1  # + the placeholder
    if drafter_kind(kind).config_defaults(model.config.num_hidden_layers, model.config.vocab_size).get("head"):
        config.update(head=args.head, rank=128, confidence=True)
    return config


def one_run(model: Any, seqs: list, data: Any, args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    from dspark.training.run import build_for_target
    from dspark.training.trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    drafter = build_for_target(model, args.drafter, sequences=seqs, **drafter_config(args.drafter, model, args))
    cfg = TrainConfig.for_kind(args.drafter, steps=1 + args.warmup + args.steps, seqs_per_step=args.seqs_per_step,
                               anchors_per_seq=args.anchors_per_seq, lr=1e-3, dtype=args.dtype, compile=compiled)
    torch._dynamo.reset()  # every compiled run compiles; none reuses the previous run's graphs
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(drafter, data, cfg, tmp, progress=False)
        t0 = time.perf_counter()
        trainer.train_step()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            trainer.train_step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        seconds = time.perf_counter() - t0
    eager_anyway = compiled and trainer.compiled.eager
    return {"mode": "compiled" if compiled else "eager", "first_step_s": first, "seconds": seconds,
            "steps": args.steps, "step_s": seconds / args.steps,
            "anchors_per_s": args.seqs_per_step * args.anchors_per_seq * args.steps / seconds,
            "fell_back": trainer.compiled.why_eager if eager_anyway else None,
            "final_loss": trainer.log[-1]["loss"]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {m: statistics.median(r["anchors_per_s"] for r in runs if r["mode"] == m) for m in MODES}
    first = {m: statistics.median(r["first_step_s"] for r in runs if r["mode"] == m) for m in MODES}
    step = {m: statistics.median(r["step_s"] for r in runs if r["mode"] == m) for m in MODES}
    return {"median_anchors_per_s": med, "ratio_compiled_over_eager": med["compiled"] / med["eager"],
            "median_first_step_s": first, "median_step_s": step,
            # the compiled first step less an eager step: compiling, and the trial's extra forward/backward
            "compile_s": first["compiled"] - step["eager"]}


def markdown(result: dict[str, Any]) -> str:
    s, c = result["summary"], result["config"]
    lines = [f"# Training throughput: eager vs torch.compile ({c['drafter']}, {c['dtype']}, {c['threads']} threads)", "",
             f"{c['seqs_per_step']} sequences × {c['anchors_per_seq']} anchors a step; {c['steps']} timed steps "
             f"after 1 + {c['warmup']} untimed, {c['repeats']} alternating repeats; torch {result['torch']}; "
             f"{result['machine']}.", "", f"Drafter: {c['drafter_config']}.", "",
             "| run | mode | first step s | step s | anchors/s |", "|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"]):
        note = f" (eager: {r['fell_back']})" if r["fell_back"] else ""
        lines.append(f"| {i // 2 + 1} | {r['mode']}{note} | {r['first_step_s']:.2f} | {r['step_s']:.3f} | "
                     f"{r['anchors_per_s']:.0f} |")
    med = s["median_anchors_per_s"]
    lines += ["", f"Median anchors/s: eager {med['eager']:.0f}, compiled {med['compiled']:.0f}; "
              f"compiled ÷ eager = **{s['ratio_compiled_over_eager']:.2f}×**. Compile time "
              f"(compiled first step − eager step): {s['compile_s']:.1f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--drafter", default="dspark", help="drafter kind (dspark, dflash, eagle3, ...)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--anchors-per-seq", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="autocast dtype")
    ap.add_argument("--repeats", type=int, default=3, help="eager/compiled pairs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=1, help="draft layers (the paper configuration: 5)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary K (0: the target's full one)")
    ap.add_argument("--head", default="gated-markov", help="DSpark's sequential head (the paper configuration: "
                    "vanilla-markov)")
    args = ap.parse_args()
    if min(args.steps, args.seqs_per_step, args.anchors_per_seq, args.repeats) < 1 or args.warmup < 0:
        ap.error("--steps, --seqs-per-step, --anchors-per-seq and --repeats must be ≥ 1, --warmup ≥ 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    from dspark.autotune import Machine
    from dspark.drafters.config import default_layer_ids
    from dspark.models import load_causal_lm
    from dspark.training.run import build_for_target, load_training_sequences
    from dspark.training.teacher import build_feature_cache
    from dspark.training.trainer import TrainData

    args.out.mkdir(parents=True, exist_ok=True)
    n = (1 + args.warmup + args.steps) * args.seqs_per_step
    seqs, pls = load_training_sequences(training_data(args.out, n), args.max_seq_len)
    model, _ = load_causal_lm("smollm2-135m", torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    probe = build_for_target(model, args.drafter, sequences=seqs, **drafter_config(args.drafter, model, args))
    L = model.config.num_hidden_layers
    layers = sorted(set(default_layer_ids(L, min(5, L - 1))) | set(probe.target_layer_ids))  # as dspark train
    t0 = time.perf_counter()
    # one cache per data size: a cache refuses to be rebuilt over other sequences
    cache = build_feature_cache(model, seqs, args.out / "data" / f"features-full-{len(seqs)}", layers, progress=False)
    cache_s = time.perf_counter() - t0
    data = TrainData(seqs, pls, cache=cache)

    runs = []
    for _ in range(args.repeats):
        for mode in MODES:
            runs.append(one_run(model, seqs, data, args, mode == "compiled"))
            print(json.dumps(runs[-1]), flush=True)
    result = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "threads": torch.get_num_threads(),
                         "sequences": len(seqs), "drafter_config": drafter_config(args.drafter, model, args)},
              "torch": torch.__version__, "machine": Machine.current().describe(), "feature_cache_s": cache_s,
              "runs": runs, "summary": summarise(runs)}
    (args.out / "train_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "train_throughput.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
