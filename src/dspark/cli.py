"""The ``dspark`` command line (same as ``python -m dspark``).

Subcommands register themselves in ``COMMANDS``; errors users can fix (bad input, a plugin that
fails to load, a missing optional package) print one line and exit 2, never a traceback.

``data``, ``train``, ``calibrate``, ``eval``, ``bench`` and ``demo`` are typed library functions
(:func:`dspark.build_data`, :func:`dspark.train`, :func:`dspark.calibrate`, :func:`dspark.evaluate`,
:func:`dspark.run_bench`, :func:`dspark.run_demo`); their handlers here only map the parsed
arguments onto the options object (``Options.from_namespace``), call the function and print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from dspark import __version__
from dspark.checkpoints import DEFAULT_DRAFTER

DEVICE_HELP = "where the target and drafter run: cpu, cuda, cuda:N or auto (CUDA when torch sees one)"
_STEP_PATHS = ("eager", "packed", "compiled")  # dspark.options.STEP_PATHS, without importing torch here


def _path_args(p: argparse.ArgumentParser, *, race: bool) -> None:
    """``--step`` (and, where the step path is raced at start-up, ``--compile / --no-compile``)."""
    what = ("how the target step runs: eager (the HF forward), packed (dspark's step with prepacked "
            "weights), compiled (that step through torch.compile)")
    if race:
        p.add_argument("--step", default="auto", choices=["auto", *_STEP_PATHS],
                       help=what + "; 'auto': raced at start-up together with the dtype")
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="let the 'auto' race try torch.compile (default: on a GPU only; on a CPU each "
                       "graph compiles for minutes at start-up, docs/serving-and-benchmarks.md)")
    else:
        p.add_argument("--step", default="packed", choices=_STEP_PATHS, help=what)

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    def deco(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (add_args, fn)
        return fn

    return deco


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# --------------------------------------------------------------------------------------------
# dspark plugins
# --------------------------------------------------------------------------------------------


def _plugins_args(p: argparse.ArgumentParser) -> None:
    p.description = "List every registered implementation per extension point."
    p.add_argument("--json", action="store_true", help="machine-readable output")


@command("plugins", _plugins_args)
def _plugins(args: argparse.Namespace) -> int:
    from dspark.plugins import EXTENSION_POINTS, list_plugins

    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind in EXTENSION_POINTS:
        print(f"{kind}:")
        entries = [r for r in rows if r["kind"] == kind]
        if not entries:
            print("  (none)")
        for r in entries:
            version = f" {r['version']}" if r["version"] else ""
            print(f"  {r['name']:<14} [{r['plugin']}{version}]  {r['description']}")
    return 0


# --------------------------------------------------------------------------------------------
# dspark demo (the README main job)
# --------------------------------------------------------------------------------------------


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "The main job on the real SmolLM2-135M target with a shipped trained drafter: greedy identity "
        "with the target (fp32), a sampling-distribution check, and the wall-clock speed-up over the "
        "best plain decode at concurrency 1, measured side by side in the dtype that is faster on this "
        "machine (measured at start-up)."
    )
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="shipped drafter name or checkpoint folder"
                   " (NAME:vocab=K: cut to its K most frequent tokens, docs/drafters-and-training.md)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--per-domain", type=int, default=2, help="held-out prompts per domain for the speed run")
    p.add_argument("--prompts", help="prompts JSONL for the speed run (default: the shipped natural-prompt eval "
                   "set, src/dspark/data/natural_eval.jsonl; the templated one: "
                   "src/dspark/checkpoints/smollm2-135m/eval_prompts.jsonl)")
    p.add_argument("--repeats", type=int, default=3, help="side-by-side repeats (the median is reported)")
    p.add_argument("--samples", type=int, default=4000, help="draws for the sampling check")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype for the speed run ('auto': the faster plain step, measured at start-up)")
    _path_args(p, race=True)
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                   help="the draft gate: stop drafting where the measured rates say it does not pay")
    p.add_argument("--scheduler", default="sps-greedy",
                   help="the speculative engine's scheduler, NAME[:KEY=VALUE,...] (e.g. sps-greedy:sunk=true, "
                   "docs/scheduling-and-calibration.md)")
    p.add_argument("--out", default="out/demo", help="folder for demo.json and demo.md")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', an HF folder or a .gguf path")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)


@command("demo", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    from dspark.demo import DemoOptions, run_demo

    demo = run_demo(DemoOptions.from_namespace(args))
    print(demo.markdown)
    print(f"wrote {demo.out / 'demo.json'} and {demo.out / 'demo.md'}")
    if not demo.all_identical:
        print("ERROR: a speculative output differs from the target's greedy decode")
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# dspark generate
# --------------------------------------------------------------------------------------------


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Generate with speculative decoding and print the text and per-request stats. At start-up the "
        "target's dtype is chosen by measurement (the faster plain step on this machine, a few seconds) "
        "unless --dtype fixes it, and the verification profile measured for it is the cost model "
        "(unless --profile or another --cost-model is given); the draft gate stops drafting where the "
        "measured rates say it does not pay."
    )
    p.add_argument("prompts", nargs="+", help="one or more prompts (each a chat user turn)")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', an HF folder or a .gguf path")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype ('auto': the faster plain step, measured at start-up)")
    _path_args(p, race=True)
    p.add_argument("--drafter", default="ngram", help="drafter name (ngram, dspark, dflash, eagle3, plugins) or 'none'")
    p.add_argument("--checkpoint", help="drafter checkpoint folder (neural drafters; FOLDER:vocab=K cuts it to "
                   "its K most frequent tokens)")
    p.add_argument("--gamma", type=int, help="draft block size γ (default 7; a --checkpoint fixes its own)")
    p.add_argument("--scheduler", default="sps-greedy")
    p.add_argument("--cost-model", default="sps-table")
    p.add_argument("--profile", help="SPS profile JSON for sps-table (default: measured at start-up)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                   help="the draft gate: stop drafting where the measured rates say it does not pay")
    p.add_argument("--calibrator", default="identity", help="calibrator name or a fitted calibrator JSON")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)


@command("generate", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    import os
    import time

    import torch

    import dspark
    from dspark.autotune import choose_dtype
    from dspark.drafters.config import MAX_GAMMA
    from dspark.engine import Engine, encode_prompt
    from dspark.models import load_causal_lm
    from dspark.options import race_paths
    from dspark.plugins import lookup

    params = dspark.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    # everything that can be checked without the model is checked before its load
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    empty = [i + 1 for i, p in enumerate(args.prompts) if not p.strip()]
    if empty:
        raise ValueError(f"prompt {', '.join(map(str, empty))} is empty")
    if args.drafter != "none":
        lookup("drafters", args.drafter)  # a misspelled name fails before the model load
    import warnings

    with warnings.catch_warnings():  # a lossy scheduler warns as it is built: refused below instead
        warnings.simplefilter("ignore")
        scheduler = dspark.get_scheduler(args.scheduler)
    if not getattr(scheduler, "lossless", False):  # what the engine refuses, before the model load
        raise ValueError(f"scheduler {args.scheduler!r} is not lossless; the engine only runs schedules that "
                         "preserve the target's distribution")
    lookup("cost_models", args.cost_model)
    looks_like_file = args.calibrator.endswith(".json") or "/" in args.calibrator
    if looks_like_file and not os.path.isfile(args.calibrator):
        raise ValueError(f"calibrator file {args.calibrator} does not exist")
    if not looks_like_file:
        lookup("calibrators", args.calibrator)
    if args.checkpoint:  # a missing checkpoint fails here, not after the model load and the race
        from dspark.checkpoints import resolve_checkpoint
        from dspark.drafters.prune import parse_drafter_ref

        resolve_checkpoint(parse_drafter_ref(args.checkpoint)[0])
    if args.checkpoint and args.gamma is not None:
        raise ValueError("--gamma cannot be combined with --checkpoint: the checkpoint fixes its block size γ")
    gamma = 7 if args.gamma is None else args.gamma
    if not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"--gamma must lie in 1..{MAX_GAMMA}, got {gamma}")
    model, tok = load_causal_lm(args.model, torch.float32, args.device)  # a device not here fails before the load
    longest = max(encode_prompt(tok, p).numel() for p in args.prompts)
    measured_cost = args.cost_model == "sps-table" and not args.profile
    choice, target = choose_dtype(model, tok, context=longest + args.max_new_tokens // 2,
                                  gamma=gamma if measured_cost else 0, dtype=args.dtype,
                                  paths=race_paths(args.step, args.compile, args.device))
    del model
    print(choice.reason, file=sys.stderr)
    if args.drafter == "none":
        drafter = None
    elif args.drafter == "ngram":
        drafter = dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=gamma)
    elif args.checkpoint:
        drafter = dspark.get_drafter(args.drafter, target=target, checkpoint=args.checkpoint)
    else:
        drafter = dspark.get_drafter(args.drafter, target=target, gamma=gamma)
        print(f"note: {args.drafter} drafter without --checkpoint is untrained (random weights)", file=sys.stderr)
    if looks_like_file:
        from dspark.calibration import load_calibrator

        calibrator = load_calibrator(args.calibrator)
    else:
        calibrator = args.calibrator
    if measured_cost:
        cost = choice.cost_model(args.model)
    else:
        cost = dspark.get_cost_model(args.cost_model, **({"profile": args.profile} if args.profile else {}))
    engine = Engine(target, drafter, scheduler=args.scheduler, cost_model=cost, calibrator=calibrator,
                    draft_gate=args.gate and drafter is not None, seed=args.seed)
    t0 = time.perf_counter()
    done = engine.generate(args.prompts, params, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t0
    for c in done:
        stats = {**c.metrics, "new_tokens": len(c.output_ids), "finish_reason": c.finish_reason}
        if args.json:
            print(json.dumps({"request_id": c.request_id, "text": c.text, **stats}))
        else:
            print(f"--- {c.request_id} ---\n{c.text}")
            print(f"[{stats['new_tokens']} tokens, {stats['rounds']} rounds, τ = {stats['tau']:.2f}, "
                  f"mean ℓ = {stats['mean_verified']:.2f}, finish: {stats['finish_reason']}]")
    total = sum(len(c.output_ids) for c in done)
    gate = engine.draft_gate
    skipped = f", the draft gate skipped the drafter in {gate.skipped_rounds} of {engine.rounds} rounds" if gate else ""
    print(f"{total} tokens in {seconds:.1f} s ({total / seconds:.1f} tok/s, {choice.label}{skipped})", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# dspark data
# --------------------------------------------------------------------------------------------


def _data_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Build self-distillation data: the target writes responses to math, code and chat prompts "
        "(built-in generated sources, natural prompts from installed packages' real text, and/or "
        "your JSONL files); a held-out split (by prompt hash; natural prompts by source unit) is "
        "written apart. Re-running resumes."
    )
    p.add_argument("--out", default="data/smollm2", help="folder for train.jsonl, eval_prompts.jsonl, meta.json")
    p.add_argument("--per-domain", type=int, default=600,
                   help="generated prompts per domain (math, code, chat) and per source")
    p.add_argument("--source", default="builtin", choices=["builtin", "natural", "both"],
                   help="generated prompts: builtin templates, natural prompts from the documentation, code "
                   "and real text of installed packages (dspark.data.natural), or both")
    p.add_argument("--followups-from", metavar="PATH",
                   help="a train.jsonl written by `dspark data`: adds multi-turn chat prompts (the target's "
                   "recorded response + a follow-up question) to the natural source")
    p.add_argument("--prompts", action="append", help="JSONL prompt file (repeatable): {prompt, domain?}")
    p.add_argument("--no-builtin", action="store_true", help="only the --prompts files")
    p.add_argument("--code-modules", help="comma-separated importable modules whose documented functions become "
                   "code prompts (default: a set of standard-library modules), e.g. numpy,torch.nn.functional")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=0,
                   help="stop once train.jsonl holds this many response tokens, earlier runs included (0: answer "
                   "every prompt); prompts run in key order, so the sample stays balanced across domains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


@command("data", _data_args)
def _data(args: argparse.Namespace) -> int:
    from dspark.data.build import DataOptions, build_data

    data = build_data(DataOptions.from_namespace(args))
    print(f"wrote {data.written} responses ({data.tokens} tokens) to {data.train_path}; "
          f"it holds {data.total_tokens} response tokens", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# dspark train
# --------------------------------------------------------------------------------------------


def _train_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Train a DSpark, DFlash or Eagle3 drafter on `dspark data` output, with target features "
        "online or from a cache. Re-running the same command resumes; `torchrun --nproc-per-node N "
        "-m dspark train ...` trains data-parallel."
    )
    p.add_argument("--data", required=True, help="a `dspark data` folder (train.jsonl)")
    p.add_argument("--out", required=True, help="run folder: state.pt, log.jsonl, curve.png, checkpoint/")
    p.add_argument("--kind", default="dspark",
                   help="drafter kind: dspark, dflash, eagle3, eagle3-fused, or one a plugin registers")
    p.add_argument("--head", default="gated-markov", choices=["vanilla-markov", "gated-markov", "rnn"])
    p.add_argument("--rank", type=int, default=256, help="sequential head rank r")
    p.add_argument("--num-layers", type=int, default=1, help="draft layers (Eagle3: always 1)")
    p.add_argument("--gamma", type=int, default=7, help="block size γ")
    p.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0: the target's)")
    p.add_argument("--layer-ids", type=_ints, help="comma-separated target layer ids (default: evenly spread)")
    p.add_argument("--init", default="target", choices=["target", "random"],
                   help="copy the target's top layers into the draft layers, or random init")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="start from a trained drafter (dspark, DeepSpec, speculators or z-lab DFlash checkpoint "
                        "folder) with a fresh optimizer: its config replaces --kind/--head/--rank/--num-layers/"
                        "--gamma/--draft-vocab/--layer-ids/--init")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seqs-per-step", type=int, default=8, help="global batch (sequences) per step")
    p.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype")
    p.add_argument("--features", default="cache", choices=["cache", "online"],
                   help="teacher features from an on-disk cache (built on first use) or online")
    p.add_argument("--feature-cache", help="cache folder (default DATA/features-full, or DATA/features for --teacher topk)")
    p.add_argument("--teacher-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="precision of the target's forward that builds the feature cache")
    p.add_argument("--teacher", default="full", choices=["full", "topk"],
                   help="full: the target's full-vocabulary distribution (the reference; the step applies the "
                        "LM head to the cached final hidden state); topk: only its --top-k most likely tokens "
                        "(L1 / acceptance rate biased)")
    p.add_argument("--top-k", type=int, default=32, help="k of the top-k teacher (--teacher topk)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--save-dtype", default="int8", choices=["float32", "float16", "bfloat16", "int8"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


@command("train", _train_args)
def _train(args: argparse.Namespace) -> int:
    from dspark.training.run import TrainOptions, train

    run = train(TrainOptions.from_namespace(args))
    code = 0
    if run.rank == 0 and not run.finished:
        print(f"stopped at step {run.step}/{run.steps}; state saved to {run.state_path} — "
              "re-run the same command to resume", file=sys.stderr)
        code = 130
    elif run.checkpoint is not None:
        final = run.log[-1]
        print(f"saved {run.checkpoint} (final loss {final['loss']:.3f}, analytic τ {final['tau']:.2f})", file=sys.stderr)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, leave without the interpreter's teardown: gloo's worker threads can still
        # be joinable when C++ static destructors run, and std::terminate then aborts a rank whose
        # work is already saved (seen once in CI, after destroy_process_group and the last barrier),
        # which fails the whole job. Everything is written and the group is gone by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# --------------------------------------------------------------------------------------------
# dspark calibrate / dspark eval
# --------------------------------------------------------------------------------------------


def _eval_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="held-out prompts JSONL (default: the shipped SmolLM2 eval prompts)")
    p.add_argument("--per-domain", type=int, default=12, help="prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run a drafter against the target on held-out prompts (every position verified), fit STS and "
        "STS + per-position bias on half of them and report ECE (20 bins) / AUROC / Brier / cumprod "
        "bias per position, raw and calibrated, on the other half. Writes the simplest of raw, STS and "
        "STS + bias whose mean held-out ECE is within 0.1 points of the lowest as calibration.json next "
        "to the checkpoint (or to --out)."
    )
    p.add_argument("checkpoint", help="checkpoint folder or shipped drafter name"
                   " (NAME:vocab=K: cut to its K most frequent tokens, docs/drafters-and-training.md)")
    p.add_argument("--out", help="folder for calibration.json and the report (default: the checkpoint)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--objective", default="ece", choices=["ece", "brier"],
                   help="STS fit: per-position survival ECE (paper) or Brier score")
    p.add_argument("--calibrator", default="best", choices=["best", "identity", "sts", "sts-bias"],
                   help="compare raw (identity), STS and STS + bias on the held-out half and ship the "
                        "simplest within 0.1 points of the lowest mean ECE (best), or fit only the one named")
    p.add_argument("--bins", type=int, default=20, help="equal-width bins of the ECE (the paper's 20)")
    p.add_argument("--reuse-rounds", action="store_true",
                   help="refit on OUT/calibration_rounds.json from an earlier run instead of decoding again")
    p.add_argument("--skip", type=int, default=12,
                   help="skip the first N prompts of each domain: the ones `dspark eval --per-domain N` uses")
    _eval_common(p)
    p.set_defaults(per_domain=40, concurrency=16)


@command("calibrate", _calibrate_args)
def _calibrate(args: argparse.Namespace) -> int:
    from dspark.evaluation_runs import CalibrateOptions, calibrate, print_calibration

    cal = calibrate(CalibrateOptions.from_namespace(args))
    print_calibration(cal.report)
    print(f"wrote {cal.calibration_path}, calibration_report.md/json, reliability.png", file=sys.stderr)
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Evaluate drafters per domain: τ, proposal length, verify rate, conditional acceptance and "
        "prefix survival per position, threshold sweep, confidence metrics (JSON, Markdown, PNG)."
    )
    p.add_argument("--drafter", action="append", required=True,
                   help="LABEL=CHECKPOINT, a checkpoint folder, a shipped drafter name, or ngram (repeatable)"
                   " (NAME:vocab=K: cut to its K most frequent tokens, docs/drafters-and-training.md)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    p.add_argument("--out", default="out/eval")
    p.add_argument("--fresh", action="store_true", help="recompute runs already recorded under OUT/rounds")
    _eval_common(p)


@command("eval", _eval_args)
def _eval(args: argparse.Namespace) -> int:
    from dspark.evaluation_runs import EvalOptions, evaluate

    ev = evaluate(EvalOptions.from_namespace(args))
    print(f"wrote {ev.json_path}, eval.md, acceptance.png", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# dspark profile
# --------------------------------------------------------------------------------------------


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure the target's verification step time over the batch shapes the engine runs (R requests "
        "× 1+ℓ tokens, padded) and context lengths, and write the profile JSON the sps-table cost model "
        "reads (records device, model, dtype, threads, date). Also reports the memory-traffic floor of a "
        "step (the weights' bytes over the read bandwidth measured here) and, with --drafter, the draft "
        "round's time beyond a plain round."
    )
    p.add_argument("--out", default="out/profile.json", help="profile JSON for --profile / sps-table")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _path_args(p, race=False)
    p.add_argument("--requests", type=_ints, default=[1, 2, 4, 8, 16], help="R values, e.g. 1,2,4,8,16")
    p.add_argument("--widths", type=_ints, default=[1, 2, 4, 8], help="1+ℓ values (tokens per request)")
    p.add_argument("--contexts", type=_ints, default=[128, 512],
                   help="KV-cache lengths; the first sets the profile's points and α(R), every other one "
                   "a curve of the profile's `contexts` (the engine reads the curves at each round's context)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", help="also time this drafter's round (shipped name or checkpoint folder) at "
                   "each R of --requests")
    p.add_argument("--quiet", action="store_true")


@command("profile", _profile_args)
def _profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from dspark.profiling import (
        device_name,
        profile_from_shapes,
        save_shapes,
        time_shapes,
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
    times = time_shapes(target, args.requests, args.widths, args.contexts, args.repeats, args.seed,
                        progress=not args.quiet)
    floor = traffic_floor(target.model)
    profile = profile_from_shapes(times, model=args.model, dtype=args.dtype, device=device_name(target),
                                  repeats=args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(out)
    save_shapes(times, out.with_suffix(".shapes.json"))
    for ctx in args.contexts:
        print(f"\nverification step (ms), {args.dtype}, {target.path} step, {ctx}-token context, {device_name(target)}, "
              f"{torch.get_num_threads()} threads:")
        print("| R \\ 1+ℓ | " + " | ".join(str(w) for w in args.widths) + " |")
        print("|---|" + "---|" * len(args.widths))
        for R in args.requests:
            print(f"| {R} | " + " | ".join(f"{times[ctx, R, w] * 1e3:.1f}" for w in args.widths) + " |")
    ctx, R1 = args.contexts[0], min(args.requests)
    t1 = times[ctx, R1, min(args.widths)]
    print(f"\nmemory-traffic floor: {floor['floor_seconds'] * 1e3:.1f} ms a step ({floor['weight_bytes'] / 1e6:.0f} MB "
          f"of weights at {floor['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s read); the {R1}-request "
          f"{min(args.widths)}-token step at a {ctx}-token context is {t1 / floor['floor_seconds']:.2f}× the floor")
    report = {"step": target.path, "dtype": args.dtype, "traffic_floor": floor}
    if args.drafter:
        report["draft_round_seconds"] = _draft_rounds(target, args, profile)
        for R, sec in report["draft_round_seconds"].items():
            ref = times[ctx, R, max(args.widths)] if (ctx, R, max(args.widths)) in times else float("nan")
            print(f"draft round beyond a plain round, R = {R}: {sec * 1e3:.1f} ms "
                  f"({sec / ref:.0%} of the {max(args.widths)}-token verification step)")
    out.with_suffix(".floor.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out} (sps-table profile), {out.with_suffix('.shapes.json')} and "
          f"{out.with_suffix('.floor.json')}", file=sys.stderr)
    return 0


def _draft_rounds(target, args: argparse.Namespace, profile) -> dict[int, float]:
    """{R: seconds a drafted round spends beyond a plain one} for ``--drafter`` on ``target``."""
    import dspark
    from dspark.bench.prior import measure_draft_overhead
    from dspark.engine import encode_prompt
    from dspark.evaluation_runs import load_drafter_spec

    _, drafter, calibrator = load_drafter_spec(args.drafter, target)
    ids = [encode_prompt(target.tokenizer, "Explain how a hash map handles collisions, with examples.")] * 2
    cost = dspark.get_cost_model("sps-table", profile=profile)
    return measure_draft_overhead(target, drafter, ids, args.requests, cost, calibrator, rounds=6)


# --------------------------------------------------------------------------------------------
# dspark bench
# --------------------------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve a workload at several concurrency levels with each scheduler (plain decoding, fixed k, "
        "threshold, sps-greedy, plugin schedulers) and report throughput, per-user rate, τ, ℓ̄, B and "
        "latency percentiles (JSON, Markdown, PNG); measured here and/or simulated from acceptance "
        "traces against a cost model (measured profile or an H200/H100 roofline). Re-running resumes."
    )
    p.add_argument("--out", default="out/bench", help="folder: bench.json, bench.md, bench.png, profile.json, runs/")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', an HF folder or a .gguf path")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    _path_args(p, race=False)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER,
                   help="shipped drafter name, checkpoint folder or LABEL=CHECKPOINT (its calibration.json is used)"
                   " (NAME:vocab=K: cut to its K most frequent tokens, docs/drafters-and-training.md)")
    p.add_argument("--calibration", help="calibrator JSON overriding the drafter's calibration.json")
    p.add_argument("--prompts", help="prompts JSONL {prompt, domain?} (default: the shipped held-out prompts)")
    p.add_argument("--per-domain", type=int, default=8, help="prompts per domain (cycled over the requests)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="levels, e.g. 1,4,16,64")
    p.add_argument("--requests-per-level", type=int, default=0, help="requests per level (default: max(2c, --min-requests))")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--arrival", default="closed", choices=["closed", "poisson"],
                   help="closed loop of c users, or Poisson arrivals at --rate with at most c active")
    p.add_argument("--rate", type=float, help="requests per second (poisson)")
    p.add_argument("--scheduler", dest="schedulers", action="append",
                   help="NAME[:KEY=VALUE,...], repeatable, e.g. --scheduler fixed:k=1 --scheduler my-plugin; "
                   "'plain' is the no-drafter baseline (default: plain, fixed:k=1, fixed:k=γ, threshold, sps-greedy); "
                   "an entry given twice runs twice (the second labelled NAME#2: an A/A control of the noise floor)")
    p.add_argument("--gate", action="append",
                   help="scheduler entry run with the draft gate, repeatable (default: sps-greedy; 'none': no gate)")
    p.add_argument("--gate-prior", default="measure",
                   help="what the draft gate assumes before it has measured: 'measure' (acceptance from the traces, "
                   "drafting overhead timed at each level; cached in OUT/gate_prior.json), a JSON path, or 'none'")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="measured repeats (medians reported, order balanced by a Williams design)")
    p.add_argument("--profile", help="sps-table profile JSON (default: measured into OUT/profile.json)")
    p.add_argument("--profile-context", type=int, default=0,
                   help="KV length for the measured profile (default: the workload's mean prompt length + "
                   "half of --max-new-tokens, the mean context a request verifies over)")
    p.add_argument("--profile-repeats", type=int, default=5, help="timed sweeps over the profile shapes (median kept)")
    p.add_argument("--mode", default="measure", choices=["measure", "simulate", "both"],
                   help="measure on this machine, simulate from traces, or both (with an agreement table)")
    p.add_argument("--traces", help="acceptance traces: a rounds JSON from dspark eval (OUT/rounds/*.json) or "
                   "calibrate (default: recorded into OUT/traces.json with every position verified)")
    p.add_argument("--sim-cost-model", default="profile", choices=["profile", "h200", "h100", "a100"],
                   help="simulation step times: the measured profile, or a GPU roofline preset")
    p.add_argument("--sim-params", type=float, default=135e6, help="target parameters for a roofline preset")
    p.add_argument("--sim-target", help="roofline presets: a target shape (smollm2-135m, llama-3.1-8b, qwen3-8b, "
                   "llama-3.1-70b) whose parameters and KV bytes per token set the step time, each step reading "
                   "R · context · KV bytes (overrides --sim-params)")
    p.add_argument("--sim-launch-overhead-ms", type=float, default=0.0, help="per-step overhead for a roofline preset")
    p.add_argument("--sim-draft-fraction", type=float, default=1 / 30,
                   help="roofline presets: drafting time as a fraction of a full block's verification step")
    p.add_argument("--sim-concurrency", type=_ints, help="simulated levels (default: --concurrency)")
    p.add_argument("--time-model", help="bench.json of a measured run whose fitted time model to reuse")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="redo runs already recorded under OUT")
    p.add_argument("--interleave", action="store_true",
                   help="run a level's schedulers side by side, one round of each in turn, each timed on its own "
                   "rounds only (a drift of the machine's speed lands on all alike; sequential runs each see "
                   "another minute)")
    p.add_argument("--replot", action="store_true", help="only redraw bench.png / bench.md from OUT/bench.json")
    p.add_argument("--quiet", action="store_true")


@command("bench", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    from dspark.bench.run import BenchOptions, replot_bench, run_bench

    if args.replot:
        png = replot_bench(args.out)
        print(f"redrew {png} and bench.md", file=sys.stderr)
        return 0
    bench = run_bench(BenchOptions.from_namespace(args))
    print(bench.markdown)
    print(f"wrote {bench.json_path}, bench.md, bench.png", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# dspark interop
# --------------------------------------------------------------------------------------------


def _interop_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write a drafter's STS calibration, a cost profile and per-batch-size draft lengths in the formats "
        "TensorRT-LLM (confidence_sts_path, confidence_sps_table_path, draft_len_schedule) and vLLM "
        "(speculative_config: adaptive verification, num_speculative_tokens_per_batch_size) read."
    )
    p.add_argument("--out", default="out/interop", help="folder: trtllm/, vllm/, best_fixed_lengths.json")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="shipped drafter name or checkpoint folder (γ, calibration.json)")
    p.add_argument("--calibration", help="calibrator JSON (default: the drafter's calibration.json)")
    p.add_argument("--profile", help="sps-table profile JSON from dspark profile / dspark bench")
    p.add_argument("--shapes", help="its per-shape timings (default: PROFILE with .shapes.json, if present)")
    p.add_argument("--traces", help="rounds JSON with every position verified (dspark eval OUT/rounds/*.json, "
                   "dspark bench OUT/traces.json) for the acceptance survival")
    p.add_argument("--bench", help="bench.json of a measured dspark bench: its fitted drafting time")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--context", type=int, help="serving KV context per request (tokens) the cost table and draft "
                   "lengths are written at; the engines' files have no context axis (default: the profile's own)")
    p.add_argument("--served-model", default="path/to/dspark-drafter", help="the drafter path written into vLLM's config")


@command("interop", _interop_args)
def _interop(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark.calibration import load_calibrator
    from dspark.checkpoints import resolve_checkpoint
    from dspark.cost_models import SPSProfile
    from dspark.drafters.checkpoint import read_config
    from dspark.interop import survival_from_rounds, write_interop
    from dspark.profiling import load_shapes

    folder = resolve_checkpoint(args.drafter)
    gamma = read_config(folder).gamma
    cal_path = Path(args.calibration) if args.calibration else folder / "calibration.json"
    calibrator = load_calibrator(cal_path) if cal_path.is_file() else None
    profile = shapes = survival = None
    if args.profile:
        profile = SPSProfile.from_json(args.profile)
        shapes_path = Path(args.shapes) if args.shapes else Path(args.profile).with_suffix(".shapes.json")
        shapes = load_shapes(shapes_path) if shapes_path.is_file() else None
    if args.traces:
        from dspark.evaluation import Rounds

        survival = survival_from_rounds(Rounds.from_dict(json.loads(Path(args.traces).read_text())))
    draft = None
    if args.bench:
        from dspark.bench.simulate import TimeModel

        draft = TimeModel.from_dict(json.loads(Path(args.bench).read_text()).get("time_model") or {}).draft_seconds
    for line in write_interop(args.out, gamma=gamma, model=args.served_model, calibrator=calibrator, profile=profile,
                              shapes=shapes, survival=survival, draft_seconds=draft,
                              max_batch_size=args.max_batch_size, context=args.context):
        print(line)
    return 0


# --------------------------------------------------------------------------------------------
# dspark convert
# --------------------------------------------------------------------------------------------


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Convert a drafter checkpoint between formats: dspark, deepspec (the paper's DeepSpec) and "
        "speculators (what vLLM serves); z-lab DFlash folders are read too. The source format is detected. "
        "What the output format cannot represent is refused, never approximated (docs/interop.md)."
    )
    p.add_argument("src", help="checkpoint folder (any readable format) or a shipped drafter's name "
                   "(NAME:vocab=K: cut to its K most frequent tokens, written with speculators' d2t / t2d; needs --target)")
    p.add_argument("out", help="output folder (written all or nothing)")
    p.add_argument("--to", required=True, choices=["dspark", "deepspec", "speculators"], help="output format")
    p.add_argument("--target", help="the target the drafter belongs to (smollm2-135m, an HF folder, a .gguf): "
                   "needed to write a reference format from a dspark checkpoint, and checked against otherwise")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the target is loaded in (the reference formats store its embedding / LM head)")
    p.add_argument("--verifier", metavar="PATH_OR_ID",
                   help="the verifier the output names (speculators_config.verifier, DeepSpec's "
                   "target_model_name_or_path): a hub id or an HF folder, e.g. one `dspark export-target` wrote "
                   "(default: the --target's hub id or folder, else what the source records)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


@command("convert", _convert_args)
def _convert(args: argparse.Namespace) -> int:
    import torch

    from dspark.checkpoints import locate
    from dspark.drafters.checkpoint import from_pretrained
    from dspark.drafters.formats import convert, detect, portable_from_drafter, with_verifier, write
    from dspark.drafters.prune import parse_drafter_ref

    path, draft_vocab = parse_drafter_ref(args.src)
    src = locate(path)
    fmt = detect(src)  # fail fast, before loading a target
    from dspark.outdir import check_replaceable

    check_replaceable(args.out, overwrite=args.overwrite, sources=(src,))  # before the target loads
    if draft_vocab is not None and not args.target:
        raise ValueError(f"{args.src}: ':vocab=K' cuts the drafter after binding it to its target; pass --target")
    target = None
    if args.target:
        from dspark.targets import load_target

        target = load_target(args.target, dtype=getattr(torch, args.dtype))
        target.name = args.target
    if draft_vocab is None:
        out = convert(src, args.to, args.out, target=target, overwrite=args.overwrite, verifier=args.verifier)
    else:  # the named variant: cut, then written like any drafter (speculators: d2t / t2d)
        drafter = from_pretrained(src, target, draft_vocab=draft_vocab)
        p = with_verifier(portable_from_drafter(drafter, target), target=target, verifier=args.verifier)
        out = write(p, args.to, args.out, overwrite=args.overwrite, sources=(src,))
    print(f"{args.src} ({fmt}) -> {out} ({args.to})")
    return 0


# --------------------------------------------------------------------------------------------
# dspark serve (dspark.serve: an OpenAI-compatible HTTP server on the engine)
# --------------------------------------------------------------------------------------------


def _serve_args(p: argparse.ArgumentParser) -> None:
    from dspark.serve.cli import add_args

    add_args(p, _demo_args, _generate_args)  # --model, --drafter, --dtype, ... as those commands declare them


@command("serve", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    from dspark.serve.cli import run

    return run(args)


# --------------------------------------------------------------------------------------------
# dspark export-target
# --------------------------------------------------------------------------------------------


def _export_target_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write a target as a plain HF folder (config with architectures, safetensors weights, tokenizer with its "
        "chat template, generation config) that transformers, speculators and vLLM load; the GGUF-loaded "
        "smollm2-135m cannot be save_pretrained as is. Name the folder as a converted drafter's verifier "
        "(dspark convert ... --verifier OUT)."
    )
    p.add_argument("target", help="smollm2-135m, an HF folder or a .gguf file")
    p.add_argument("out", help="output folder (written all or nothing)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (float32 keeps the logits dspark's target computes)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if dspark wrote it")


@command("export-target", _export_target_args)
def _export_target(args: argparse.Namespace) -> int:
    import torch

    from dspark.models import export_target

    out = export_target(args.target, args.out, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    print(f"{args.target} -> {out} (HF folder)")
    return 0


# --------------------------------------------------------------------------------------------
# dspark export (same as python -m dspark.export)
# --------------------------------------------------------------------------------------------


def _export_args(p: argparse.ArgumentParser) -> None:
    from dspark.export.cli import add_args  # the options python -m dspark.export declares, once

    add_args(p)


@command("export", _export_args)
def _export(args: argparse.Namespace) -> int:
    from dspark.export.cli import run_parsed

    return run_parsed(args)


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="Confidence-scheduled speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=SUMMARIES.get(name))
        add_args(p)
        p.set_defaults(func=fn)
    return parser


# One line per command for `dspark --help` (each command's --help has the whole description).
SUMMARIES = {
    "plugins": "list every registered implementation per extension point",
    "demo": "the main job: identity, sampling check and speed-up on the real target",
    "generate": "generate text with speculative decoding",
    "data": "build self-distillation data written by the target",
    "train": "train a DSpark, DFlash or Eagle3 drafter",
    "calibrate": "fit and report the confidence calibration of a drafter",
    "eval": "evaluate drafters: τ, acceptance, calibration per domain",
    "profile": "measure the verification step and write a cost profile",
    "bench": "benchmark schedulers under load, measured and simulated",
    "interop": "write calibration and cost tables for TensorRT-LLM and vLLM",
    "convert": "convert a drafter between dspark, DeepSpec and speculators formats",
    "serve": "an OpenAI-compatible HTTP server on the engine",
    "export-target": "write the target as a plain HF folder (for vLLM, speculators)",
    "export": "export a drafter to ONNX / TensorRT",
}


# What a user can fix (exit 2) and what the environment must (exit 3): a missing optional package,
# a full disk, a device that failed. Anything else is reported as unexpected, still in one line.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, KeyError, TypeError, FileNotFoundError,
                                                 IsADirectoryError, NotADirectoryError, FileExistsError)
_ENVIRONMENT_ERRORS: tuple[type[BaseException], ...] = (ImportError, OSError, MemoryError, RuntimeError)


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    first = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return first or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    from dspark.plugins import PluginError

    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        print(f"dspark {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dspark plugins --json | head`: the reader left, nothing is wrong
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter flushes stdout at exit
        except OSError:
            pass
        return 0
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, (PluginError, *_USER_ERRORS)):
            code, what = 2, "error"
        elif isinstance(exc, _ENVIRONMENT_ERRORS):
            code, what = 3, "error"
        else:
            code, what = 3, f"unexpected error ({type(exc).__name__})"
        hint = "" if code == 2 else " (--debug shows the traceback)"
        print(f"dspark {args.command}: {what}: {_one_line(exc)}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
