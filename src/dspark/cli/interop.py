"""Commands that meet other engines: ``dspark interop`` (TensorRT-LLM / vLLM tables), ``convert``
(drafter checkpoint formats), ``serve`` (the OpenAI-compatible server), ``export-target`` (the
target as a plain HF folder) and ``export`` (ONNX / TensorRT)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dspark.cli.core import command, emit, out_arg, target_arg

log = logging.getLogger("dspark.cli")

# --------------------------------------------------------------------------------------------
# dspark interop
# --------------------------------------------------------------------------------------------


def _interop_args(p: argparse.ArgumentParser) -> None:
    from dspark.checkpoints import DEFAULT_DRAFTER

    p.description = (
        "Write a drafter's STS calibration, a cost profile and per-batch-size draft lengths in the formats "
        "TensorRT-LLM (confidence_sts_path, confidence_sps_table_path, draft_len_schedule) and vLLM "
        "(speculative_config: adaptive verification, num_speculative_tokens_per_batch_size) read."
    )
    out_arg(p, "folder: trtllm/, vllm/, best_fixed_lengths.json", default="out/interop")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, metavar="NAME|DIR",
                   help="a shipped drafter's name or a checkpoint folder (its γ and calibration.json)")
    p.add_argument("--calibration", help="calibrator JSON (default: the drafter's calibration.json)")
    p.add_argument("--profile", help="sps-table profile JSON from dspark profile / dspark bench")
    p.add_argument("--shapes", help="its per-shape timings (default: PROFILE with .shapes.json, if present)")
    p.add_argument("--traces", help="rounds JSON with every position verified (dspark eval OUT/rounds/*.json, "
                   "dspark bench OUT/traces.json) for the acceptance survival")
    p.add_argument("--bench", help="bench.json of a measured dspark bench: its fitted drafting time")
    p.add_argument("--max-batch-size", type=int, default=256, help="largest batch the tables cover")
    p.add_argument("--context", type=int, help="serving KV context per request (tokens) the cost table and draft "
                   "lengths are written at; the engines' files have no context axis (default: the profile's own)")
    p.add_argument("--served-model", default="path/to/dspark-drafter", help="the drafter path written into vLLM's config")


@command("interop", _interop_args, summary="write calibration and cost tables for TensorRT-LLM and vLLM")
def _interop(args: argparse.Namespace) -> int:
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
        from dspark.evaluation.rounds import Rounds

        survival = survival_from_rounds(Rounds.from_dict(json.loads(Path(args.traces).read_text())))
    draft = None
    if args.bench:
        from dspark.bench.simulate import TimeModel

        draft = TimeModel.from_dict(json.loads(Path(args.bench).read_text()).get("time_model") or {}).draft_seconds
    lines = write_interop(args.out, gamma=gamma, model=args.served_model, calibrator=calibrator, profile=profile,
                          shapes=shapes, survival=survival, draft_seconds=draft,
                          max_batch_size=args.max_batch_size, context=args.context)
    emit(args, {"out": args.out, "written": lines}, "\n".join(lines))
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
    p.add_argument("--drafter", required=True, metavar="NAME|DIR",
                   help="checkpoint folder (any readable format) or a shipped drafter's name (NAME:vocab=K: cut to "
                   "its K most frequent tokens, written with speculators' d2t / t2d; needs --target)")
    out_arg(p, "output folder (written all or nothing)", required=True)
    p.add_argument("--to", required=True, choices=["dspark", "deepspec", "speculators"], help="output format")
    p.add_argument("--target", dest="model", metavar="TARGET",
                   help="the target the drafter belongs to (smollm2-135m, an HF folder, a .gguf): needed to write a "
                   "reference format from a dspark checkpoint, and checked against otherwise")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the target is loaded in (the reference formats store its embedding / LM head)")
    p.add_argument("--verifier", metavar="PATH_OR_ID",
                   help="the verifier the output names (speculators_config.verifier, DeepSpec's "
                   "target_model_name_or_path): a hub id or an HF folder, e.g. one `dspark export-target` wrote "
                   "(default: the --target's hub id or folder, else what the source records)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


@command("convert", _convert_args, summary="convert a drafter between dspark, DeepSpec and speculators formats")
def _convert(args: argparse.Namespace) -> int:
    import torch

    from dspark.checkpoints import locate
    from dspark.drafters.checkpoint import from_pretrained
    from dspark.drafters.formats import convert, detect, portable_from_drafter, with_verifier, write
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.outdir import check_replaceable

    path, draft_vocab = parse_drafter_ref(args.drafter)
    src = locate(path)
    fmt = detect(src)  # fail fast, before loading a target
    check_replaceable(args.out, overwrite=args.overwrite, sources=(src,))  # before the target loads
    if draft_vocab is not None and not args.model:
        raise ValueError(f"{args.drafter}: ':vocab=K' cuts the drafter after binding it to its target; pass --target")
    target = None
    if args.model:
        from dspark.targets import load_target

        target = load_target(args.model, dtype=getattr(torch, args.dtype))
        target.name = args.model
    if draft_vocab is None:
        out = convert(src, args.to, args.out, target=target, overwrite=args.overwrite, verifier=args.verifier)
    else:  # the named variant: cut, then written like any drafter (speculators: d2t / t2d)
        drafter = from_pretrained(src, target, draft_vocab=draft_vocab)
        p = with_verifier(portable_from_drafter(drafter, target), target=target, verifier=args.verifier)
        out = write(p, args.to, args.out, overwrite=args.overwrite, sources=(src,))
    emit(args, {"drafter": args.drafter, "source_format": fmt, "out": out, "format": args.to},
         f"{args.drafter} ({fmt}) -> {out} ({args.to})")
    return 0


# --------------------------------------------------------------------------------------------
# dspark serve (dspark.serve: an OpenAI-compatible HTTP server on the engine)
# --------------------------------------------------------------------------------------------


def _serve_args(p: argparse.ArgumentParser) -> None:
    from dspark.cli.run import demo_args, generate_args
    from dspark.serve.cli import add_args

    add_args(p, demo_args, generate_args)  # --target, --drafter, --dtype, ... as those commands declare them


@command("serve", _serve_args, summary="an OpenAI-compatible HTTP server on the engine", reports=False)
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
    target_arg(p, required=True)
    out_arg(p, "output folder (written all or nothing)", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (float32 keeps the logits dspark's target computes)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if dspark wrote it")


@command("export-target", _export_target_args, summary="write the target as a plain HF folder (for vLLM, speculators)")
def _export_target(args: argparse.Namespace) -> int:
    import torch

    from dspark.models import export_target

    out = export_target(args.model, args.out, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    emit(args, {"target": args.model, "out": out}, f"{args.model} -> {out} (HF folder)")
    return 0


# --------------------------------------------------------------------------------------------
# dspark export (same as python -m dspark.export)
# --------------------------------------------------------------------------------------------


def _export_args(p: argparse.ArgumentParser) -> None:
    from dspark.export.cli import add_args  # the options python -m dspark.export declares, once

    add_args(p)


@command("export", _export_args, summary="export a drafter to ONNX / TensorRT")
def _export(args: argparse.Namespace) -> int:
    from dspark.export.cli import run_parsed

    return run_parsed(args)
