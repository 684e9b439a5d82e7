"""The neutral form every checkpoint format is read into and written from (:class:`Portable`), and
the helpers the formats and the kinds' format rules share: errors, ``config.json`` fields of a
Qwen3 draft layer, the verifier's name and layer count, tensor-name maps.

Layer ids: dspark and DeepSpec count decoder layers from 0 (id L = the output of decoder layer L =
transformers' ``hidden_states[L + 1]``); speculators / vLLM index like ``hidden_states`` (0 = the
embedding output), so their layer ids are the DeepSpec ids + 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen

from dspark.drafters.config import DrafterConfig
from dspark.drafters.files import CheckpointError, _read_weights
from dspark.drafters.kinds import drafter_kind
from dspark.drafters.layers import LayerShape

__all__ = ["FormatError", "Portable", "CONFIG_NAME", "WEIGHTS_NAME", "TARGET_KEYS", "EXTRAS_KEY",
           "DEEPSPEC_EXTRAS", "to_reference_keys", "from_reference_keys", "shape_fields", "layer_config",
           "dtype_name", "need", "check_ids", "verifier_config", "verifier_layers", "verifier_name",
           "read_extras", "load_weights"]

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")
# Fields a format holds that the neutral form does not (training settings, not the model): kept
# per format in Portable.extras so that a round trip through other formats writes them back. The
# dspark format stores them under "reference_fields", the speculators format under this key.
EXTRAS_KEY = "dspark_reference_fields"
DEEPSPEC_EXTRAS = ("num_anchors", "step_loss_decay")


class FormatError(CheckpointError):
    """A checkpoint folder in no known format, or a drafter a format cannot represent."""


def to_reference_keys(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module keys of a ``kind`` drafter → reference keys (its DrafterKind's map; the identity for
    a kind whose module already carries the reference names, the reference-layout Eagle3)."""
    return drafter_kind(kind).to_reference_keys(state)


def from_reference_keys(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference keys → the module keys of a ``kind`` drafter (``model.`` prefixes dropped)."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    return drafter_kind(kind).from_reference_keys(state)


@frozen
class Portable:
    """A drafter in no particular format: config, reference-keyed weights, verifier facts."""

    config: DrafterConfig
    weights: dict[str, torch.Tensor]  # reference keys; embed_tokens / lm_head only if the source has them
    verifier: str | None = None  # the target's hub id or path, as the source records it (None: unrecorded)
    verifier_architectures: tuple[str, ...] = field(default=(), converter=tuple)
    max_positions: int | None = None
    source_format: str = "dspark"
    # False when the source does not record the verifier's layer count (speculators without the
    # verifier's config at hand): config.target.num_layers is then only a lower bound
    verifier_layers_known: bool = True
    path: Path | None = None  # the folder it was read from (named in errors)
    # format → {field: value} the neutral form does not hold (DEEPSPEC_EXTRAS), written back to that format
    extras: dict[str, dict[str, Any]] = field(factory=dict)


def shape_fields(cfg: dict[str, Any], where: Path) -> LayerShape:
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise FormatError(f"{where}: rope type {rope_type!r} is not supported (dspark's draft layers use default RoPE)")
    if cfg.get("attention_bias"):
        raise FormatError(f"{where}: attention_bias=true is not supported (reference draft layers have no biases)")
    return LayerShape(
        hidden_size=cfg["hidden_size"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 1e6), qk_norm=True,
    )


def layer_config(shape: LayerShape, num_layers: int, vocab: int, max_positions: int | None) -> dict[str, Any]:
    """A Qwen3 decoder config for the draft layers (DeepSpec's top level, speculators' nested)."""
    return {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "head_dim": shape.head_dim, "hidden_act": "silu", "hidden_size": shape.hidden_size,
        "initializer_range": 0.02, "intermediate_size": shape.intermediate_size,
        "layer_types": ["full_attention"] * num_layers, "max_position_embeddings": max_positions or 32768,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": shape.num_heads,
        "num_hidden_layers": num_layers, "num_key_value_heads": shape.num_kv_heads, "pad_token_id": None,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": vocab,
    }


def dtype_name(weights: dict[str, torch.Tensor]) -> str:
    dts = {v.dtype for v in weights.values() if v.is_floating_point()}
    return str(next(iter(dts))).removeprefix("torch.") if len(dts) == 1 else "float32"


def load_weights(root: Path) -> dict[str, torch.Tensor]:
    return _read_weights(root / WEIGHTS_NAME)


def need(cfg: dict[str, Any], where: Path, fmt: str, *names: str) -> None:
    missing = [n for n in names if n not in cfg]
    if missing:
        raise FormatError(f"{where}: {fmt} config lacks {', '.join(missing)}")


def verifier_config(name: str | None, root: Path | None) -> dict[str, Any]:
    """The verifier's config.json when ``name`` is a local folder (absolute, or relative to the
    checkpoint's parent folder or the current one), else {}."""
    bases = (root.parent, Path.cwd()) if root is not None else (Path.cwd(),)
    for base in bases:
        cand = base / str(name or "") / CONFIG_NAME
        if name and cand.is_file():
            try:
                cfg = json.loads(cand.read_text())
            except (ValueError, UnicodeDecodeError):
                return {}
            return cfg if isinstance(cfg, dict) else {}
    return {}


def verifier_layers(name: str | None, root: Path) -> int | None:
    """The verifier's layer count, from its config.json when ``name`` is a local folder."""
    try:
        return int(verifier_config(name, root)["num_hidden_layers"])
    except (ValueError, KeyError, TypeError):
        return None


def check_ids(ids: list[int], where: Path, field_name: str) -> list[int]:
    bad = [i for i in ids if i < 0]
    if bad:
        raise FormatError(f"{where}: {field_name} asks for the embedding output (layer id −1), which dspark's "
                          "target does not capture")
    return ids


def verifier_name(p: Portable, field_name: str) -> str:
    """The verifier as a reference format names it: a hub id or an HF folder that speculators /
    vLLM / DeepSpec can load (a dspark alias becomes its hub id); refused when unknown or a GGUF file."""
    from dspark.models import hub_id

    name = p.verifier if p.verifier not in (None, "", "unknown") else None
    name = (hub_id(name) or name) if name else None
    if not name:
        raise FormatError(f"cannot write {field_name}: the source does not name its verifier; pass --verifier "
                          "PATH_OR_ID (a hub id or an HF folder, e.g. one `dspark export-target` wrote) or --target")
    if name.endswith(".gguf"):
        raise FormatError(f"cannot write {field_name}: the verifier {name!r} is a GGUF file, which speculators and "
                          "vLLM do not load; write it as an HF folder with `dspark export-target` and pass "
                          "--verifier FOLDER")
    return name


def read_extras(value: Any, where: Path) -> dict[str, dict[str, Any]]:
    """A stored Portable.extras ({format: {field: value}}), checked."""
    if value is None:
        return {}
    if not (isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())):
        raise FormatError(f"{where}: {EXTRAS_KEY} / reference_fields must map each format to an object of fields")
    return {str(k): dict(v) for k, v in value.items()}
