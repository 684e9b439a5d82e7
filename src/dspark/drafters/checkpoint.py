"""Saving and loading neural drafters: ``config.json`` + ``model.safetensors``.

A checkpoint records the target it was trained for (name, vocab size, hidden size, number of
layers) and the target layer ids; loading it against another target fails with a message naming
each mismatch. The target's embedding and LM head are never stored: they are bound from the target
at load time.

:func:`from_pretrained` also reads the reference formats — DeepSpec, speculators (vLLM) and z-lab
DFlash — detected from ``config.json`` (``dspark.drafters.formats``; docs/interop.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dspark.drafters import formats
from dspark.drafters.config import FORMAT_VERSION, DrafterConfig
from dspark.drafters.files import (  # noqa: F401 (re-exported: the names users import from here)
    CONFIG_NAME,
    FORMAT,
    QUANT_SUFFIX,
    WEIGHTS_NAME,
    CheckpointError,
    _dspark_config,
    _read_json,
    dequantize_int8,
    quantize_int8,
)

__all__ = ["save_pretrained", "from_pretrained", "read_config"]

def save_pretrained(drafter: Any, path: str | Path, dtype: torch.dtype | None = None, quantize: bool = False) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (optionally cast, e.g. torch.float16, and
    with ``quantize`` large matrices stored as row-wise int8)."""
    from safetensors.torch import save_file

    from dspark import __version__

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous()
             for k, v in drafter.state_dict().items()}
    if quantize:
        state = {k: v.contiguous() for k, v in quantize_int8(state).items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "dspark_version": __version__,
            "config": drafter.config.to_dict()}
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> DrafterConfig:
    """The :class:`DrafterConfig` of a checkpoint folder in any readable format, without building
    the drafter."""
    root = Path(path)
    meta = _read_json(root / CONFIG_NAME)
    if not meta.get("format"):  # a reference format
        return formats.read(root).config
    return _dspark_config(meta, root / CONFIG_NAME)


def from_pretrained(path: str | Path, target: Any = None, draft_vocab: int | None = None) -> Any:
    """Load a drafter checkpoint folder — dspark's own (:func:`save_pretrained`), DeepSpec,
    speculators or z-lab DFlash, detected from its ``config.json`` — or a shipped drafter by name
    (:func:`dspark.checkpoints.shipped`, e.g. ``"dspark-5l-xl"``); with ``target``, check the
    checkpoint was made for it and bind it. ``draft_vocab`` K (needs ``target``): the named variant
    that drafts only the K most frequent tokens of the folder's ``token_ranking.json``
    (:mod:`dspark.drafters.prune`), also written ``"NAME:vocab=K"`` in ``path``. A folder's
    ``confidence.json`` becomes the drafter's ``confidence_model`` (None without one), which
    :class:`dspark.Engine` uses by default."""
    from dspark.checkpoints import locate, shipped
    from dspark.drafters.prune import parse_drafter_ref

    if not Path(path).exists():  # "NAME:vocab=K" (a folder of that name is read as the folder)
        path, ref_vocab = parse_drafter_ref(str(path))
        if ref_vocab is not None and draft_vocab not in (None, ref_vocab):
            raise ValueError(f"{path}:vocab={ref_vocab} and draft_vocab={draft_vocab} ask for different cuts")
        draft_vocab = ref_vocab if ref_vocab is not None else draft_vocab
    path = locate(path)
    if not Path(path).exists():
        raise CheckpointError(f"{path} does not exist: neither a checkpoint folder nor a shipped drafter "
                              f"(shipped: {', '.join(shipped()) or 'none'})")
    drafter = formats.build(formats.read(path), target)
    if draft_vocab is not None:
        from dspark.drafters.prune import prune_draft_vocab, read_token_ranking

        if target is None:
            raise ValueError("draft_vocab needs the target (the drafter is cut after binding to it)")
        ranking = read_token_ranking(path, drafter.config.vocab_size)
        if draft_vocab > len(ranking):
            raise ValueError(f"{Path(path) / 'token_ranking.json'} ranks {len(ranking)} tokens; cannot keep {draft_vocab}")
        drafter = prune_draft_vocab(drafter, ranking[:draft_vocab])
    drafter.confidence_model = folder_confidence_model(path, draft_vocab)  # the engine's default
    return drafter


def folder_confidence_model(path: str | Path, draft_vocab: int | None = None) -> Any:
    """The confidence model a checkpoint folder gives its drafter (its ``confidence.json``, or
    None). Not for a vocabulary cut, whose proxy features differ from those it was fitted on (the
    head and its calibration.json still apply: the head does not read the vocabulary)."""
    from dspark.confidence import load_confidence_model

    return load_confidence_model(path) if draft_vocab is None else None
