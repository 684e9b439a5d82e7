"""Checkpoint files: the errors, the int8 storage, reading ``config.json`` / safetensors, checking
a checkpoint's target and loading its tensors into a drafter. Shared by :mod:`dspark.drafters.checkpoint`
(dspark's own format) and :mod:`dspark.drafters.formats` (the reference formats), which both build on
it and not on each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dspark.drafters.config import DrafterConfig, TargetInfo

__all__ = ["CheckpointError", "FORMAT", "CONFIG_NAME", "WEIGHTS_NAME", "QUANT_SUFFIX", "quantize_int8",
           "dequantize_int8"]

FORMAT = "dspark.drafter"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model or target."""


QUANT_SUFFIX = ".int8_scale"  # per-row scales of an int8-stored matrix


def quantize_int8(state: dict[str, torch.Tensor], min_numel: int = 65536) -> dict[str, torch.Tensor]:
    """Row-wise symmetric int8 for large float matrices: W ≈ q · s[:, None], q int8, s fp16 [rows].

    Storage only (weights are dequantised on load); it halves fp16 checkpoints, with a relative
    error per weight of at most 1/254 of its row's largest magnitude.
    """
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.ndim == 2 and v.numel() >= min_numel:
            s = v.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [rows]
            out[k] = torch.round(v.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
            out[k + QUANT_SUFFIX] = s.half()
        else:
            out[k] = v
    return out


def dequantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state.items() if not k.endswith(QUANT_SUFFIX)}
    for k in list(out):
        s = state.get(k + QUANT_SUFFIX)
        if s is not None:
            out[k] = out[k].float() * s.float()[:, None]
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return dequantize_int8(load_file(str(path)))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def _target_info(target: Any) -> TargetInfo:
    return TargetInfo(getattr(target, "name", "target"), target.vocab_size, target.hidden_size, target.num_layers)


def _bind(drafter: Any, target: Any) -> None:
    model = target.model
    param = next(model.parameters())
    drafter.to(device=param.device, dtype=param.dtype)  # the drafter runs where the target does
    drafter.bind_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)


def _load_state(drafter: Any, state: dict[str, torch.Tensor], where: Path) -> None:
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match a {drafter.config.kind} drafter with this config "
            f"(missing: {missing[:5]}{'…' if len(missing) > 5 else ''}; "
            f"unexpected: {unexpected[:5]}{'…' if len(unexpected) > 5 else ''})"
        )
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(f"{where}: {k} has shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


def _dspark_config(meta: dict[str, Any], where: Path) -> DrafterConfig:
    """The :class:`DrafterConfig` of a parsed dspark ``config.json`` (``where`` names it in errors)."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a dspark drafter config (format {meta.get('format')!r})")
    try:
        return DrafterConfig.from_dict(meta["config"], meta.get("format_version", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: bad drafter config: {exc}") from None
