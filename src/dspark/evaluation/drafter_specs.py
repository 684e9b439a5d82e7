"""Drafter specs as ``dspark eval`` / ``calibrate`` / ``bench`` take them — ``LABEL=CHECKPOINT``, a
checkpoint folder, a shipped drafter's name, ``ngram``, each optionally ``:vocab=K`` — and the
calibrator that goes with a checkpoint folder's drafter."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["calibration_label", "calibrator_beside", "check_drafter_spec", "folder_calibrator", "load_drafter_spec",
           "spec_label", "spec_path", "split_label"]


def load_drafter_spec(spec: str, target: Any) -> tuple[str, Any, Any]:
    """``LABEL=CHECKPOINT``, a checkpoint folder, a shipped drafter name, or ``ngram`` →
    (label, drafter, calibrator or None). A ``calibration.json`` next to the weights is loaded.
    ``CHECKPOINT:vocab=K`` is the variant cut to the K most frequent tokens (:mod:`dspark.drafters.prune`;
    default label ``NAME-vocabK``)."""
    import dspark
    from dspark.drafters.prune import parse_drafter_ref

    label = spec_label(spec)
    path, draft_vocab = parse_drafter_ref(split_label(spec)[1])
    if path == "ngram":
        return label, dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=7), None
    from dspark.checkpoints import resolve_checkpoint

    folder = resolve_checkpoint(path)
    from dspark.drafters.checkpoint import from_pretrained

    drafter = from_pretrained(folder, target, draft_vocab=draft_vocab)
    return label, drafter, calibrator_beside(folder, drafter.confidence_model)


def folder_calibrator(folder: Any, draft_vocab: int | None = None) -> Any:
    """The calibrator for the confidence logits the engine reads from a checkpoint folder's drafter
    (its confidence model as :func:`~dspark.drafters.checkpoint.folder_confidence_model` gives it):
    :func:`calibrator_beside` it."""
    from dspark.drafters.checkpoint import folder_confidence_model

    return calibrator_beside(folder, folder_confidence_model(folder, draft_vocab))


def calibrator_beside(folder: Any, confidence_model: Any) -> Any:
    """None when ``confidence_model`` (the folder's drafter's) is calibrated itself (``stacked``),
    else the folder's ``calibration.json`` (fitted on the confidence head's logits), else None."""
    from dspark.calibration import load_calibrator

    if getattr(confidence_model, "calibrated", False):
        return None
    cal = Path(folder) / "calibration.json"
    return load_calibrator(cal) if cal.is_file() else None


def calibration_label(calibrator: Any, confidence_model: Any) -> str | None:
    """What calibrates the engine's confidences, for reports: the folder's calibration.json, a
    confidence.json calibrated itself, or None (raw)."""
    if calibrator is not None:
        return f"{calibrator.name} (calibration.json)"
    return f"{confidence_model.name} (confidence.json)" if getattr(confidence_model, "calibrated", False) else None


def split_label(spec: str) -> tuple[str, str]:
    """``LABEL=REF`` → (LABEL, REF); a spec without a label → ("", spec). The '=' of a bare
    ``NAME:vocab=K`` is not a label's."""
    label, sep, ref = spec.partition("=")
    return (label, ref) if sep and not label.endswith(":vocab") else ("", spec)


_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def spec_label(spec: str) -> str:
    """The label of a drafter spec: ``LABEL`` of ``LABEL=REF``, else the checkpoint folder's name
    (``NAME-vocabK`` for a ``:vocab=K`` variant). It names files under the output folder, so it
    must be one plain file name (letters, digits, ``. _ + -``); anything else is a ValueError."""
    from dspark.drafters.prune import parse_drafter_ref, variant_label

    label, ref = split_label(spec)
    path, draft_vocab = parse_drafter_ref(ref)
    if not label:
        p = Path(path)
        label = variant_label((p.parent.name if p.name == "checkpoint" else p.name) or path, draft_vocab)
    if not _LABEL.fullmatch(label):
        raise ValueError(f"drafter label {label!r} (from {spec!r}) is not a plain file name: use letters, digits "
                         "and . _ + - (LABEL=CHECKPOINT sets one)")
    return label


def spec_path(spec: str) -> str:
    """The checkpoint of a ``LABEL=CHECKPOINT[:vocab=K]`` spec (or the spec itself)."""
    from dspark.drafters.prune import parse_drafter_ref

    return parse_drafter_ref(split_label(spec)[1])[0]


def check_drafter_spec(spec: str) -> str:
    """What :func:`load_drafter_spec` would refuse without a target (a checkpoint that is not
    there, a label that is not a file name) → the digest of the checkpoint's files."""
    from dspark.checkpoints import resolve_checkpoint
    from dspark.provenance import files_digest

    spec_label(spec)
    if spec_path(spec) == "ngram":
        return "ngram"
    return files_digest(resolve_checkpoint(spec_path(spec)))
