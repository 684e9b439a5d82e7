"""``dspark data``, ``dspark train`` and ``dspark calibrate``: making a drafter — the self-distillation
data, the training run, the confidence calibration. Each is a typed library function
(:func:`dspark.build_data`, :func:`dspark.train`, :func:`dspark.calibrate`) whose options class
declares the command's options."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import attrs

from dspark.cli.core import command, emit

log = logging.getLogger("dspark.cli")

# --------------------------------------------------------------------------------------------
# dspark data
# --------------------------------------------------------------------------------------------


def _data_args(p: argparse.ArgumentParser) -> None:
    from dspark.data.build import DataOptions
    from dspark.options import add_arguments

    p.description = (
        "Build self-distillation data: the target writes responses to math, code and chat prompts "
        "(built-in generated sources, natural prompts from installed packages' real text, and/or "
        "your JSONL files); a held-out split (by prompt hash; natural prompts by source unit) is "
        "written apart. Re-running resumes."
    )
    add_arguments(p, DataOptions)


@command("data", _data_args, summary="build self-distillation data written by the target")
def _data(args: argparse.Namespace) -> int:
    from dspark.data.build import DataOptions, build_data

    data = build_data(DataOptions.from_namespace(args))
    result = {**attrs.asdict(data), "train_path": data.train_path, "eval_prompts_path": data.eval_prompts_path,
              "meta_path": data.meta_path}
    summary = (f"wrote {data.written} responses ({data.tokens} tokens) to {data.train_path}; "
               f"it holds {data.total_tokens} response tokens")
    emit(args, result, summary)
    return 0


# --------------------------------------------------------------------------------------------
# dspark train
# --------------------------------------------------------------------------------------------


def _train_args(p: argparse.ArgumentParser) -> None:
    from dspark.options import add_arguments
    from dspark.training.run import TrainOptions

    p.description = (
        "Train a DSpark, DFlash or Eagle3 drafter on `dspark data` output, with target features "
        "online or from a cache. Re-running the same command resumes; `torchrun --nproc-per-node N "
        "-m dspark train ...` trains data-parallel."
    )
    add_arguments(p, TrainOptions)


@command("train", _train_args, summary="train a DSpark, DFlash or Eagle3 drafter")
def _train(args: argparse.Namespace) -> int:
    from dspark.training.run import TrainOptions, train

    run = train(TrainOptions.from_namespace(args))
    code, text = 0, None
    final = run.log[-1] if run.log else None
    if run.rank == 0 and not run.finished:
        text = (f"stopped at step {run.step}/{run.steps}; state saved to {run.state_path} — re-run the same "
                "command to resume")
        code = 130
    elif run.checkpoint is not None:
        text = f"saved {run.checkpoint} (final loss {final['loss']:.3f}, analytic τ {final['tau']:.2f})"
    if run.rank == 0:  # one report, from the first rank
        emit(args, {"out": run.out, "step": run.step, "steps": run.steps, "finished": run.finished,
                    "checkpoint": run.checkpoint, "state_path": run.state_path, "final": final,
                    "summary": run.summary}, text)
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
# dspark calibrate
# --------------------------------------------------------------------------------------------


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    from dspark.evaluation.calibration_run import CalibrateOptions
    from dspark.options import add_arguments

    p.description = (
        "Run a drafter against the target on held-out prompts (every position verified), fit STS and "
        "STS + per-position bias on half of them and report ECE (20 bins) / AUROC / Brier / cumprod "
        "bias per position, raw and calibrated, on the other half. Writes the simplest of raw, STS and "
        "STS + bias whose mean held-out ECE is within 0.1 points of the lowest as calibration.json next "
        "to the checkpoint (or to --out)."
    )
    add_arguments(p, CalibrateOptions)


@command("calibrate", _calibrate_args, summary="fit and report the confidence calibration of a drafter")
def _calibrate(args: argparse.Namespace) -> int:
    from dspark.evaluation.calibration_run import CalibrateOptions, calibrate
    from dspark.evaluation.reports import print_calibration

    cal = calibrate(CalibrateOptions.from_namespace(args))
    if args.json:
        emit(args, {"calibration_path": cal.calibration_path, "report": cal.report}, None)
    else:
        print_calibration(cal.report)
    log.info("wrote %s, calibration_report.md/json, reliability.png", cal.calibration_path)
    return 0
