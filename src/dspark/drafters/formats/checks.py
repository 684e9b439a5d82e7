"""Checks of a :class:`~dspark.drafters.formats.portable.Portable` before anything is built or
written from it: that it was made for the target at hand, and that every tensor fits its config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from attrs import evolve

from dspark.drafters.config import DrafterConfig
from dspark.drafters.files import _target_info
from dspark.drafters.formats.portable import (
    TARGET_KEYS,
    FormatError,
    Portable,
    from_reference_keys,
    to_reference_keys,
)

__all__ = ["check_verifier", "check_tensors"]


def check_verifier(p: Portable, target: Any) -> DrafterConfig:
    """The config fitted to ``target`` (its layer count), after checking the checkpoint was made
    for it: dimensions, layer ids, and the copies of its embedding / LM head the checkpoint holds."""
    info = _target_info(target)
    config = p.config
    if p.source_format != "dspark":
        config = evolve(config, target=evolve(config.target, num_layers=info.num_layers))
    config.target.check_compatible(info, config.target_layer_ids)
    model = target.model
    own = {"embed_tokens.weight": model.get_input_embeddings().weight,
           "lm_head.weight": model.get_output_embeddings().weight}
    for key, mine in own.items():
        theirs = p.weights.get(key)
        if theirs is None:
            continue
        if key == "lm_head.weight" and "draft_ids" in p.weights and theirs.shape[0] == len(p.weights["draft_ids"]) - 1:
            mine = mine[p.weights["draft_ids"][:-1]]  # a reduced vocabulary's rows, in draft-slot order
        if tuple(theirs.shape) != tuple(mine.shape):
            raise FormatError(f"checkpoint {key} has shape {tuple(theirs.shape)}, target {info.name!r} has "
                              f"{tuple(mine.shape)}: it was made for another verifier ({p.verifier or 'unrecorded'!r})")
        a, b = theirs.float(), mine.detach().float()
        if p.config.mask_token_id is not None and key == "embed_tokens.weight":
            keep = torch.ones(a.shape[0], dtype=torch.bool)
            keep[p.config.mask_token_id] = False
            a, b = a[keep], b[keep]
        tol = 1e-2 * b.abs().max().clamp_min(1e-6)  # bf16 copies of fp32 weights round by < 1 %
        if (a - b).abs().max() > tol:
            raise FormatError(f"checkpoint's {key} differs from target {info.name!r}'s: the drafter was made for "
                              f"another verifier ({p.verifier or 'unrecorded'!r})")
    return config


def check_tensors(p: Portable, where: Path, *, complete: bool = True) -> None:
    """Every tensor of ``p`` against its config, on a module built on the meta device (no memory, so
    a hostile size in config.json costs nothing): shapes, floating dtypes and, with ``complete``,
    no key missing and none unexpected (the target's embedding / LM head and a mask placeholder may
    be there or not). One sentence naming the key, as the checkpoint names it."""
    from dspark.drafters.neural import build_drafter

    config = p.config
    try:
        with torch.device("meta"):
            ghost = build_drafter(config)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise FormatError(f"{where}: the config does not describe a {config.kind} drafter: {exc}") from None
    expected = to_reference_keys(config.kind, ghost.state_dict())

    def own(key: str) -> str:  # the name the checkpoint itself uses
        return key if p.source_format != "dspark" else next(iter(from_reference_keys(config.kind, {key: None})))

    for key, want in expected.items():
        got = p.weights.get(key)
        if got is None:
            if complete:
                raise FormatError(f"{where}: {own(key)} is missing for this {config.kind} config")
            continue
        if tuple(got.shape) != tuple(want.shape):
            raise FormatError(f"{where}: {own(key)} has shape {tuple(got.shape)}, but this "
                              f"{config.kind} config needs {tuple(want.shape)}")
        if want.is_floating_point() and not got.is_floating_point():
            raise FormatError(f"{where}: {own(key)} holds {str(got.dtype).removeprefix('torch.')}, not floats")
    if complete:
        optional = {*TARGET_KEYS, "mask_embedding"}
        extra = sorted(k for k in p.weights if k not in expected and k not in optional)
        if extra:
            raise FormatError(f"{where}: {own(extra[0])} is not a weight of this {config.kind} config"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
