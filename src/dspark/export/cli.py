"""``python -m dspark.export``: a trained drafter checkpoint → ONNX graphs (+ TensorRT engines).

    python -m dspark.export --drafter NAME|DIR[:vocab=K] --out OUT_DIR [--target smollm2-135m] [--validate]
    python -m dspark.export --drafter NAME|DIR --out OUT_DIR --trt [--fp16 | --bf16] [--profile NAME|FILE]
                            [--batch MIN,OPT,MAX] [--past MIN,OPT,MAX] [--new MIN,OPT,MAX] [--validate]

Step progress goes to the ``dspark.export`` loggers at INFO (stderr, as for every ``dspark``
command: ``-q`` silences it, ``-v`` adds debug messages); results go to stdout.

Exit status: 0 done; 1 ``--validate`` found a mismatch; 2 bad input (one line on stderr, no
traceback); 3 TensorRT: ``--trt`` on a machine where tensorrt is missing or cannot be imported, or
CUDA is not usable — checked *before* the target loads, nothing is written — or a TensorRT failure
later (parser, build, engine load, a shape outside the profile), one sentence each.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)

PROG = "python -m dspark.export"
# --validate tolerances for TensorRT, relative to max(1, max |logit|): guesses, not measurements.
TRT_TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1e-1}


class _Progress:
    """Numbered steps with their durations: a live tqdm line on a terminal, INFO log lines otherwise;
    nothing where INFO is not logged (``-q``, or a library caller that configured no logging)."""

    def __init__(self, total: int) -> None:
        self.total, self.enabled, self.n = total, log.isEnabledFor(logging.INFO), 0
        self.label: str | None = None
        self.t0 = time.perf_counter()
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} [{elapsed}]")

    def __call__(self, label: str) -> None:
        self._finish()
        self.n += 1
        self.label, self.t0 = label, time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str(label)
        elif self.enabled:
            log.info("[%d/%d] %s …", self.n, self.total, label)

    def _finish(self) -> None:
        if self.label is None:
            return
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            log.info("[%d/%d] %s: %.1f s", self.n, self.total, self.label, time.perf_counter() - self.t0)
        self.label = None

    def close(self) -> None:
        self._finish()
        if self.bar is not None:
            self.bar.close()


DESCRIPTION = ("Export a trained dspark / dflash / eagle3 drafter to ONNX (the context, backbone "
               "and head graphs + manifest.json) and optionally build TensorRT engines from them.")


def build_parser() -> argparse.ArgumentParser:
    from dspark.cli.core import verbosity_parent

    p = argparse.ArgumentParser(prog=PROG, parents=[verbosity_parent()])  # -v / -q as every dspark command
    add_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    """The export options on ``p``: ``python -m dspark.export`` and ``dspark export`` share them
    (messages name the command as ``p.prog`` spells it)."""
    p.description = DESCRIPTION
    p.set_defaults(export_prog=p.prog)  # "dspark export" or "python -m dspark.export": what the user typed
    p.add_argument("--drafter", dest="checkpoint", required=True, metavar="NAME|DIR",
                   help="drafter folder written by save_pretrained (config.json + model.safetensors) or a shipped "
                   "drafter's name; NAME:vocab=K exports its named variant cut to the K most frequent tokens of its "
                   "token_ranking.json (docs/drafters-and-training.md)")
    p.add_argument("--out", required=True, metavar="OUT_DIR", help="write the ONNX graphs and manifest.json here")
    p.add_argument("--trt", action="store_true", help="then build TensorRT engines from the ONNX graphs in OUT_DIR")
    p.add_argument("--target", default="smollm2-135m",
                   help="the target whose embedding / LM head the graphs bake in: 'smollm2-135m' "
                        "(default), an HF model folder or a .gguf file (anything load_target accepts)")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true",
                      help="TensorRT: fp16 engines (TensorRT 10: builder flag, norms pinned to fp32; "
                           "TensorRT 11: strongly typed from fp16 graphs with fp32 norms)")
    prec.add_argument("--bf16", action="store_true", help="TensorRT: bf16 engines (as --fp16)")
    p.add_argument("--strongly-typed", action="store_true",
                   help="TensorRT: build --fp16/--bf16 engines strongly typed from reduced-precision ONNX "
                        "graphs also on TensorRT 10 (TensorRT 11 always does)")
    p.add_argument("--profile", metavar="NAME|FILE", help="TensorRT optimisation profile: a JSON file or a "
                   "shipped preset (default, interactive-fp16, serving-bf16)")
    for axis, what in (("batch", "requests per round"), ("past", "context length before the anchor"),
                       ("new", "context positions ingested per call")):
        p.add_argument(f"--{axis}", metavar="MIN,OPT,MAX", help=f"TensorRT profile range for {what}")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (>= 17; default 17)")
    p.add_argument("--validate", action="store_true",
                   help="run the exported drafter next to the PyTorch one and compare logits and drafts")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _checkpoint_kind(ckpt: Path) -> dict[str, Any]:
    from dspark.export.manifest import ExportError

    if not ckpt.exists():
        raise ExportError(f"checkpoint {ckpt} does not exist")
    from dspark.drafters.checkpoint import CheckpointError, read_config

    try:  # any readable format (dspark, DeepSpec, speculators, z-lab DFlash), before the target loads
        return read_config(ckpt).to_dict()
    except CheckpointError as exc:
        raise ExportError(f"{ckpt} is not a drafter checkpoint in a readable format: {_one_line(exc)}") from None


def _validate(reference: Any, exported: Any, atol_rel: float, require_tokens: bool, label: str,
              target: Any = None, to_stderr: bool = False) -> bool:
    from dspark.export.validate import compare_drafters

    # Real target features (natural prompts) when the target can capture them; TF32 off throughout.
    report = compare_drafters(reference, exported, target=target)
    atol = atol_rel * max(1.0, report.logit_scale)
    ok = (report.exported_finite and report.max_abs_logits <= atol
          and (report.greedy_tokens_equal or not require_tokens))
    verdict = "ok" if ok else f"FAILED (tolerance {atol:.1e})"
    print(f"validate {label}: {report.summary()} — {verdict}", file=sys.stderr if to_stderr else sys.stdout)
    return ok


def _run(args: argparse.Namespace) -> int:
    from dspark.checkpoints import locate
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.export.exporter import prepare_out_dir
    from dspark.export.manifest import ExportError

    out = Path(args.out)
    path, draft_vocab = parse_drafter_ref(args.checkpoint)
    ckpt = locate(path)
    cfg = _checkpoint_kind(ckpt)
    if draft_vocab is not None and cfg.get("draft_vocab_size") is not None:
        raise ExportError(f"{args.checkpoint}: ':vocab=K' cuts a full-vocabulary drafter, and {ckpt} already has a "
                          f"reduced vocabulary (draft_vocab_size {cfg['draft_vocab_size']})")
    profile, precisions = None, ()
    if args.trt:
        from dspark.export.tensorrt.build import uses_strong_typing
        from dspark.export.tensorrt.environment import import_tensorrt, tensorrt_problem
        from dspark.export.tensorrt.profile import load_profile

        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else None
        profile = load_profile(args.profile, batch=args.batch, past=args.past, new=args.new, precision=precision,
                               strongly_typed=True if args.strongly_typed else None)
        # Fail fast: tensorrt really imported, CUDA usable, a builder created — before the target
        # loads and before anything is written.
        problem = tensorrt_problem(probe=True)
        if problem:
            print(f"{_prog(args)}: TensorRT engines cannot be built here because {problem}; nothing was exported "
                  f"({_prog(args)} --drafter CHECKPOINT --out {out} without --trt writes the ONNX files, "
                  "and 'pip install dspark[gpu]' on a CUDA machine adds TensorRT).", file=sys.stderr)
            return 3
        trt, _ = import_tensorrt()
        if uses_strong_typing(trt, profile):  # the engines are built from reduced-precision graphs
            precisions = (profile.precision,)
    elif args.fp16 or args.bf16 or args.profile or args.batch or args.past or args.new or args.strongly_typed:
        raise ExportError("--fp16/--bf16/--strongly-typed/--profile/--batch/--past/--new are TensorRT options: "
                          "use them with --trt")
    created = not out.exists()
    prepare_out_dir(out)
    try:
        return _export(args, out, ckpt, cfg, profile, precisions, draft_vocab)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a failed export leaves no empty folder behind
        raise


def _export(args: argparse.Namespace, out: Path, ckpt: Path, cfg: dict[str, Any], profile: Any,
            precisions: tuple[str, ...] = (), draft_vocab: int | None = None) -> int:
    import torch

    from dspark.drafters.kinds import drafter_kind
    from dspark.export.exporter import check_opset, export_onnx
    from dspark.export.manifest import ExportError

    check_opset(args.opset)  # before the target loads
    n_graphs = len(drafter_kind(str(cfg.get("kind"))).graph_names(cfg))
    total = (2 + n_graphs * (1 + len(precisions)) + bool(args.validate)
             + (n_graphs + bool(args.validate) if args.trt else 0))
    progress = _Progress(total)
    try:
        progress(f"loading target {args.target}")
        from transformers.utils import logging as hf_logging

        from dspark.drafters.checkpoint import from_pretrained
        from dspark.targets import load_target

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # transformers' own loading bars would break ours
        try:
            target = load_target(args.target)
        except (OSError, ImportError, ValueError) as exc:
            raise ExportError(f"cannot load target {args.target!r}: {_one_line(exc)}") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        progress(f"loading drafter {args.checkpoint}")
        drafter = from_pretrained(ckpt, target, draft_vocab=draft_vocab)
        if drafter.dtype != torch.float32:
            drafter = drafter.float()
        manifest = export_onnx(drafter, out, opset=args.opset, target_spec=args.target, checkpoint=ckpt,
                               progress=progress, precisions=precisions)
        ok = True
        if args.validate:
            progress("validating with onnxruntime")
            from dspark.export.ort import OrtDrafter

            ok &= _validate(drafter, OrtDrafter.from_dir(out, threads=torch.get_num_threads()), 1e-4, True,
                            "onnxruntime vs PyTorch (fp32)", target, to_stderr=bool(getattr(args, "json", False)))
        if args.trt:
            from dspark.export.tensorrt.build import build_engines
            from dspark.export.tensorrt.environment import TensorRTError
            from dspark.export.tensorrt.runtime import TensorRTDrafter

            try:
                manifest = build_engines(out, profile, progress=progress)
                if args.validate:
                    progress("validating with TensorRT")
                    # Relative tolerances, guesses until measured on a GPU: fp32 (TF32 off in the
                    # engine and in torch) must also draft identical greedy tokens.
                    tol = TRT_TOLERANCE[profile.precision]
                    ok &= _validate(drafter, TensorRTDrafter.from_dir(out), tol, profile.precision == "fp32",
                                    f"TensorRT ({profile.precision}) vs PyTorch", target,
                                    to_stderr=bool(getattr(args, "json", False)))
            except TensorRTError as exc:
                progress.close()
                _summary(out, manifest, bool(getattr(args, "json", False)))
                print(f"{_prog(args)}: TensorRT: {_one_line(exc)} (the ONNX files in {out} are written and checked)",
                      file=sys.stderr)
                return 3
    finally:
        progress.close()
    _summary(out, manifest, bool(getattr(args, "json", False)), ok)
    return 0 if ok else 1


def _summary(out: Path, manifest: dict[str, Any], as_json: bool = False, ok: bool | None = None) -> None:
    rows = [(e["file"], e["bytes"]) for e in manifest["graphs"].values()]
    rows += [(e["file"], e["bytes"]) for e in (manifest.get("engines") or {}).values()]
    if as_json:  # --json: one object on stdout
        import json

        print(json.dumps({"kind": manifest["kind"], "gamma": manifest["gamma"], "vocab_size": manifest["vocab_size"],
                          "out": str(out), "files": dict(rows), "validated": ok}, indent=2))
        return
    print(f"{manifest['kind']} drafter (γ={manifest['gamma']}, V={manifest['vocab_size']}) → {out}/")
    for name, size in rows:
        print(f"  {name:<16} {size / 2**20:9.1f} MiB")
    print("  manifest.json")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dspark.export ARGS``, logging set up as ``dspark`` sets it up (-v / -q)."""
    from dspark.cli.core import configure_logging

    args = build_parser().parse_args(argv)
    undo = configure_logging(args.verbose, args.quiet)
    try:
        return run_parsed(args)
    finally:
        undo()


def _prog(args: argparse.Namespace) -> str:
    """The command as the user typed it, for the first word of a message."""
    return getattr(args, "export_prog", PROG)


def run_parsed(args: argparse.Namespace) -> int:
    """Run an export from parsed :func:`add_args` options; every failure is one line and an exit code."""
    from dspark.drafters.checkpoint import CheckpointError
    from dspark.export.manifest import ExportError
    from dspark.export.tensorrt.environment import TensorRTError

    try:
        return _run(args)
    except TensorRTError as exc:
        print(f"{_prog(args)}: TensorRT: {_one_line(exc)}", file=sys.stderr)
        return 3
    except (ExportError, CheckpointError, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError, ImportError) as exc:
        print(f"{_prog(args)}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_prog(args)}: interrupted", file=sys.stderr)
        return 130
