"""Drafter checkpoint formats: dspark's own, DeepSpec (the paper's code), speculators (what vLLM
serves) and z-lab DFlash — detected, read and written (docs/interop.md, field by field).

Every format is read into one neutral form, a :class:`Portable`: the :class:`DrafterConfig`, the
weights under the *reference* key names (DeepSpec = speculators: ``fc``, ``hidden_norm``,
``layers.N.self_attn.q_proj``, ``markov_head.markov_w1``, ``confidence_head.proj``, …) with the
dtypes and bytes they were stored with, the target's ``embed_tokens`` / ``lm_head`` where the
checkpoint carries them, and what the source says about its verifier. Writers take a Portable, so
DeepSpec ⇄ speculators conversion copies tensors untouched (only ``config.json`` differs).

Layer ids: dspark and DeepSpec count decoder layers from 0 (id L = the output of decoder layer L =
transformers' ``hidden_states[L + 1]``); speculators / vLLM index like ``hidden_states`` (0 = the
embedding output), so their ``aux_hidden_state_layer_ids`` are the DeepSpec ids + 1.

What a format cannot represent is refused with one sentence naming it (:class:`FormatError`),
never approximated: vLLM's DSpark model has only the vanilla head, so gated / rnn heads go to the
DeepSpec format only; reference formats embed the mask slots with a target token's embedding, so
a learned mask vector has no place there; their draft layers are Qwen3 layers (q/k norm).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from attrs import evolve, field, frozen

from dspark.drafters.config import FORMAT_VERSION, DrafterConfig, TargetInfo
from dspark.drafters.files import (
    CheckpointError,
    _bind,
    _dspark_config,
    _load_state,
    _read_json,
    _read_weights,
    _target_info,
)
from dspark.drafters.kinds import drafter_kind, kind_names
from dspark.drafters.layers import LayerShape
from dspark.drafters.speculators_vocab import from_speculators_vocab, to_speculators_vocab

__all__ = ["FORMATS", "SPECULATORS_VERSION", "FormatError", "Portable", "detect", "read", "write", "convert", "build",
           "portable_from_drafter", "with_verifier"]

FORMATS = ("dspark", "deepspec", "speculators", "zlab-dflash")
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
# The speculators release whose config layout the writer follows (the ``interop`` extra pins it;
# its SpeculatorModel.from_pretrained loads what the writer writes: tests/test_interop_speculators.py).
SPECULATORS_VERSION = "0.9.0"
# Fields a format holds that the neutral form does not (training settings, not the model): kept
# per format in Portable.extras so that a round trip through other formats writes them back. The
# dspark format stores them under "reference_fields", the speculators format under this key.
EXTRAS_KEY = "dspark_reference_fields"
_DEEPSPEC_EXTRAS = ("num_anchors", "step_loss_decay")
_HEAD_NAMES = {"vanilla-markov": "vanilla", "gated-markov": "gated", "rnn": "rnn"}  # dspark ↔ DeepSpec


def _spec_arch(kind: str) -> str | None:
    """speculators' architecture name of a drafter kind (its DrafterKind states it; None: none)."""
    return drafter_kind(kind).speculators_arch if kind in kind_names() else None


class FormatError(CheckpointError):
    """A checkpoint folder in no known format, or a drafter a format cannot represent."""


# ---------------------------------------------------------------------------------------------
# Key names: dspark's BlockDrafter ⇄ the reference. (Eagle3's module uses the reference names.)
# ---------------------------------------------------------------------------------------------

# (dspark key prefix, reference key prefix); {i} stands for a layer index. Written once, compiled
# into both directions below; the first matching prefix renames a key.
_KEY_PREFIXES = [
    ("fuse.", "fc."),
    ("fuse_norm.", "hidden_norm."),
    *[(f"layers.{{i}}.{n}.", f"layers.{{i}}.self_attn.{n}.") for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "q_norm", "k_norm")],
    *[(f"layers.{{i}}.{n}.", f"layers.{{i}}.mlp.{n}.") for n in ("gate_proj", "up_proj", "down_proj")],
    ("layers.{i}.input_norm.", "layers.{i}.input_layernorm."),
    ("layers.{i}.post_norm.", "layers.{i}.post_attention_layernorm."),
    ("head.w_down.", "markov_head.markov_w1."),
    ("head.w_up.", "markov_head.markov_w2."),
    ("head.w_g.", "markov_head.gate_proj."),
    ("head.w.", "markov_head.joint_proj."),
]
TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")


def _rules(src: int) -> list[tuple[re.Pattern[str], str]]:
    """Regexes from prefix ``src`` (0: dspark, 1: reference) to the other."""
    out = []
    for pair in _KEY_PREFIXES:
        pattern = "^" + re.escape(pair[src]).replace(re.escape("{i}"), r"(\d+)")
        out.append((re.compile(pattern), pair[1 - src].replace("{i}", r"\1")))
    return out


_TO_REF, _FROM_REF = _rules(0), _rules(1)


def _rename(state: dict[str, torch.Tensor], rules: list[tuple[re.Pattern[str], str]]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        k = key
        for pattern, repl in rules:
            k, hit = pattern.subn(repl, key)
            if hit:
                break
        out[k] = value
    return out


def to_reference_keys(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dspark module keys → reference keys (the identity for a kind whose module already carries
    the reference names, ``DrafterKind.reference_keys`` False: the reference-layout Eagle3)."""
    return _rename(state, _TO_REF) if drafter_kind(kind).reference_keys else dict(state)


def from_reference_keys(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference keys → dspark module keys (``model.`` prefixes dropped)."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    return _rename(state, _FROM_REF) if drafter_kind(kind).reference_keys else dict(state)


# ---------------------------------------------------------------------------------------------
# The neutral form
# ---------------------------------------------------------------------------------------------


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
    # format → {field: value} the neutral form does not hold (_DEEPSPEC_EXTRAS), written back to that format
    extras: dict[str, dict[str, Any]] = field(factory=dict)


def _shape_fields(cfg: dict[str, Any], where: Path) -> LayerShape:
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


def _layer_config(shape: LayerShape, num_layers: int, vocab: int, max_positions: int | None) -> dict[str, Any]:
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


def _dtype_name(weights: dict[str, torch.Tensor]) -> str:
    dts = {v.dtype for v in weights.values() if v.is_floating_point()}
    return str(next(iter(dts))).removeprefix("torch.") if len(dts) == 1 else "float32"


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------


def _lacks(cfg: dict[str, Any]) -> dict[str, str]:
    """For each format, the field it needs that ``cfg`` lacks ('' where it matches)."""
    archs = " ".join(cfg.get("architectures") or [])
    return {
        "dspark": "" if cfg.get("format") == "dspark.drafter" else "'format': 'dspark.drafter'",
        "speculators": "" if "speculators_model_type" in cfg else "'speculators_model_type'",
        "deepspec": "" if ("target_layer_ids" in cfg and re.search(r"(DSpark|Eagle3)Model", archs))
        else "'target_layer_ids' with architectures *DSparkModel / *Eagle3Model",
        "zlab-dflash": "" if ("dflash_config" in cfg or "DFlash" in archs) else "'dflash_config' (or a DFlash architecture)",
    }


def _config(root: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of checkpoint folder ``root``."""
    if not root.exists():
        raise FormatError(f"checkpoint folder {root} does not exist")
    if not (root / CONFIG_NAME).is_file():
        raise FormatError(f"{root} is not a drafter checkpoint folder (no {CONFIG_NAME})")
    return _read_json(root / CONFIG_NAME)


def detect(path: str | Path) -> str:
    """The format of checkpoint folder ``path``: one of :data:`FORMATS`."""
    root = Path(path)
    return _format_of(_config(root), root)


def _format_of(cfg: dict[str, Any], root: Path) -> str:
    lacks = _lacks(cfg)
    for fmt in FORMATS:
        if not lacks[fmt]:
            return fmt
    raise FormatError(
        f"{root} is in no known drafter format; tried "
        + "; ".join(f"{fmt} (lacks {need})" for fmt, need in lacks.items())
    )


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


def _weights(root: Path) -> dict[str, torch.Tensor]:
    return _read_weights(root / WEIGHTS_NAME)


def _need(cfg: dict[str, Any], where: Path, fmt: str, *names: str) -> None:
    missing = [n for n in names if n not in cfg]
    if missing:
        raise FormatError(f"{where}: {fmt} config lacks {', '.join(missing)}")


def _verifier_config(name: str | None, root: Path | None) -> dict[str, Any]:
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


def _verifier_layers(name: str | None, root: Path) -> int | None:
    """The verifier's layer count, from its config.json when ``name`` is a local folder."""
    try:
        return int(_verifier_config(name, root)["num_hidden_layers"])
    except (ValueError, KeyError, TypeError):
        return None


def _block_config(kind: str, cfg: dict[str, Any], shape: LayerShape, ids: list[int], target: TargetInfo,
                  gamma: int, sample_from_anchor: bool, where: Path) -> DrafterConfig:
    rank = int(cfg.get("markov_rank") or 0)
    head = None
    if kind == "dspark" and rank:
        htype = cfg.get("markov_head_type", "vanilla")
        names = {v: k for k, v in _HEAD_NAMES.items()}
        if htype not in names:
            raise FormatError(f"{where}: markov_head_type {htype!r} is not one of {sorted(names)}")
        head = names[htype]
    confidence = bool(cfg.get("enable_confidence_head"))
    if confidence and not cfg.get("confidence_head_with_markov", True):
        raise FormatError(f"{where}: a confidence head without the Markov embedding is not supported")
    if kind == "dspark" and not head:
        kind, confidence = "dflash", False  # DeepSpec's DFlash: the same class with markov_rank 0
    return DrafterConfig(
        kind=kind, vocab_size=cfg["vocab_size"], layer=shape, target=target, target_layer_ids=tuple(ids),
        num_layers=cfg["num_hidden_layers"], gamma=gamma, head=head, rank=rank or 256,
        confidence=confidence, mask_token_id=cfg.get("mask_token_id"), sample_from_anchor=sample_from_anchor,
    )


def _check_ids(ids: list[int], where: Path, field_name: str) -> list[int]:
    bad = [i for i in ids if i < 0]
    if bad:
        raise FormatError(f"{where}: {field_name} asks for the embedding output (layer id −1), which dspark's "
                          "target does not capture")
    return ids


def _read_deepspec(root: Path, cfg: dict[str, Any]) -> Portable:
    where = root / CONFIG_NAME
    _need(cfg, where, "DeepSpec", "target_layer_ids", "vocab_size", "hidden_size", "num_hidden_layers",
          "num_attention_heads", "intermediate_size")
    arch = " ".join(cfg.get("architectures") or [])
    shape = _shape_fields(cfg, where)
    ids = _check_ids(list(cfg["target_layer_ids"]), where, "target_layer_ids")
    n_target = cfg.get("num_target_layers") or _verifier_layers(cfg.get("target_model_name_or_path"), root)
    if n_target is None:
        raise FormatError(f"{where}: DeepSpec config lacks num_target_layers")
    verifier = cfg.get("target_model_name_or_path")  # Eagle3 configs only
    target = TargetInfo(verifier or "unknown", cfg["vocab_size"], cfg["hidden_size"], int(n_target))
    if "Eagle3" in arch:
        config = DrafterConfig(kind="eagle3", vocab_size=cfg["vocab_size"], layer=shape, target=target,
                               target_layer_ids=tuple(ids), num_layers=cfg["num_hidden_layers"],
                               gamma=int(cfg.get("ttt_length", 7)))
    else:
        _need(cfg, where, "DeepSpec", "block_size", "mask_token_id")
        config = _block_config("dspark", cfg, shape, ids, target, int(cfg["block_size"]), True, where)
    kept = {k: cfg[k] for k in _DEEPSPEC_EXTRAS if k in cfg}
    extras = {"deepspec": kept} if kept else {}
    return Portable(config, _weights(root), verifier, (), cfg.get("max_position_embeddings"), "deepspec",
                    extras=extras)


def _read_speculators(root: Path, cfg: dict[str, Any]) -> Portable:
    where = root / CONFIG_NAME
    kind = cfg["speculators_model_type"]
    servable = [k for k in kind_names() if _spec_arch(k)]
    if kind not in servable:
        raise FormatError(f"{where}: speculators_model_type {kind!r} is not one of {servable}")
    _need(cfg, where, "speculators", "transformer_layer_config", "speculators_config")
    layer = cfg["transformer_layer_config"]
    shape = _shape_fields(layer, where)
    spec = cfg["speculators_config"]
    verifier = spec.get("verifier") or {}
    methods = spec.get("proposal_methods") or [{}]
    ids_field = "eagle_aux_hidden_state_layer_ids" if kind == "eagle3" else "aux_hidden_state_layer_ids"
    _need(cfg, where, "speculators", ids_field)
    ids = _check_ids([i - 1 for i in cfg[ids_field]], where, ids_field)
    name = verifier.get("name_or_path")
    n_known = _verifier_layers(name, root)
    n_target = n_known or max(ids) + 2  # a lower bound; replaced by the target's own count when loading
    target = TargetInfo(str(name or "unknown"), layer["vocab_size"], layer["hidden_size"], n_target)
    weights = _weights(root)
    draft_vocab, V = int(cfg.get("draft_vocab_size") or layer["vocab_size"]), layer["vocab_size"]
    if not 2 <= draft_vocab <= V:
        raise FormatError(f"{where}: draft_vocab_size {draft_vocab} is not in [2, the verifier's vocabulary {V}]")
    if draft_vocab < V:  # d2t / t2d → dspark's draft slots (draft_ids, the placeholder slot)
        weights = from_speculators_vocab(weights, V, draft_vocab, root / WEIGHTS_NAME)
    elif "d2t" in weights:  # a full vocabulary may still ship the identity map
        if weights["d2t"].any():
            raise FormatError(f"{where}: draft_vocab_size equals the vocabulary ({V}) but d2t is not the identity")
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    reduced = {"draft_vocab_size": draft_vocab + 1} if draft_vocab < V else {}
    if kind == "eagle3":
        flags = [f for f in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual") if cfg.get(f)]
        if flags:
            raise FormatError(f"{where}: Eagle3 with {', '.join(flags)} is the llama-style EAGLE-3 variant, not "
                              "the DeepSpec layout dspark implements")
        config = DrafterConfig(kind="eagle3", vocab_size=layer["vocab_size"], layer=shape, target=target,
                               target_layer_ids=tuple(ids), num_layers=layer["num_hidden_layers"],
                               gamma=int(methods[0].get("speculative_tokens", 7)), **reduced)
    else:
        _need(cfg, where, "speculators", "block_size", "mask_token_id")
        sfa = bool(cfg.get("sample_from_anchor", kind == "dspark"))
        gamma = int(cfg["block_size"]) - (0 if sfa else 1)
        config = evolve(_block_config(kind, {**layer, **cfg}, shape, ids, target, gamma, sfa, where), **reduced)
    return Portable(config, weights, str(name) if name else None, tuple(verifier.get("architectures") or ()),
                    layer.get("max_position_embeddings"), "speculators", n_known is not None,
                    extras=_extras(cfg.get(EXTRAS_KEY), where))


def _read_zlab(root: Path, cfg: dict[str, Any]) -> Portable:
    where = root / CONFIG_NAME
    dcfg = cfg.get("dflash_config") or {}
    merged = {**cfg, **dcfg}
    _need(merged, where, "z-lab DFlash", "target_layer_ids", "mask_token_id", "block_size", "vocab_size",
          "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    shape = _shape_fields(cfg, where)
    ids = _check_ids(list(merged["target_layer_ids"]), where, "target_layer_ids")
    n_known = cfg.get("num_target_layers")
    n_target = n_known or max(ids) + 2  # a lower bound when unrecorded
    target = TargetInfo(cfg.get("target_name") or "unknown", cfg["vocab_size"], cfg["hidden_size"], int(n_target))
    # z-lab drafts from the mask slots only: a block of B gives B − 1 drafts.
    config = _block_config("dflash", {**cfg, "markov_rank": 0, "mask_token_id": merged["mask_token_id"]}, shape,
                           ids, target, int(merged["block_size"]) - 1, False, where)
    weights = {k.removeprefix("model."): v for k, v in _weights(root).items()}
    return Portable(config, weights, cfg.get("target_name"), (), cfg.get("max_position_embeddings"),
                    "zlab-dflash", n_known is not None)


def _read_dspark(root: Path, cfg: dict[str, Any]) -> Portable:
    config = _dspark_config(cfg, root / CONFIG_NAME)
    state = _weights(root)
    return Portable(config, to_reference_keys(config.kind, state), config.target.name, (), None, "dspark",
                    extras=_extras(cfg.get("reference_fields"), root / CONFIG_NAME))


def _extras(value: Any, where: Path) -> dict[str, dict[str, Any]]:
    """A stored Portable.extras ({format: {field: value}}), checked."""
    if value is None:
        return {}
    if not (isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())):
        raise FormatError(f"{where}: {EXTRAS_KEY} / reference_fields must map each format to an object of fields")
    return {str(k): dict(v) for k, v in value.items()}


_READERS = {"dspark": _read_dspark, "deepspec": _read_deepspec, "speculators": _read_speculators,
            "zlab-dflash": _read_zlab}


def read(path: str | Path) -> Portable:
    """Read checkpoint folder ``path`` in whichever format it is in."""
    root = Path(path)
    cfg = _config(root)
    fmt = _format_of(cfg, root)
    try:
        return evolve(_READERS[fmt](root, cfg), path=root)
    except (KeyError, TypeError) as exc:
        raise FormatError(f"{root / CONFIG_NAME}: bad {fmt} config ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:
        if isinstance(exc, CheckpointError):  # already names the file and the problem
            raise
        raise FormatError(f"{root / CONFIG_NAME}: bad {fmt} config: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Building a drafter from a Portable
# ---------------------------------------------------------------------------------------------


def _check_verifier(p: Portable, target: Any) -> DrafterConfig:
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


def build(p: Portable, target: Any = None) -> Any:
    """A drafter module from a Portable (checked against and bound to ``target`` when given)."""
    from dspark.drafters.neural import build_drafter

    config = _check_verifier(p, target) if target is not None else p.config
    where = p.path / WEIGHTS_NAME if p.path is not None else Path(f"<{p.source_format} checkpoint>")
    check_tensors(evolve(p, config=config), where, complete=False)  # before allocating anything
    drafter = build_drafter(config)
    state = from_reference_keys(config.kind, {k: v for k, v in p.weights.items() if k not in TARGET_KEYS})
    if config.mask_token_id is not None:
        state.pop("mask_embedding", None)  # vLLM's loader skips this placeholder too
    _load_state(drafter, state, where)
    if target is not None:
        _bind(drafter, target)
    return drafter.eval()


def portable_from_drafter(drafter: Any, target: Any = None) -> Portable:
    """A Portable of a (bound) dspark drafter; the bound target embedding / LM head become
    ``embed_tokens`` / ``lm_head`` (what the reference formats store)."""
    config = drafter.config
    weights = to_reference_keys(config.kind, {k: v.detach() for k, v in drafter.state_dict().items()})
    if getattr(drafter, "_embed", None) is not None:
        dt = next(drafter.parameters()).dtype
        weights["embed_tokens.weight"] = drafter._embed.to(dt)
        weights["lm_head.weight"] = drafter._lm_head_full.to(dt)
    max_pos = getattr(getattr(getattr(target, "model", None), "config", None), "max_position_embeddings", None)
    return Portable(config, weights, config.target.name, target_architectures(target), max_pos, "dspark")


def target_architectures(target: Any) -> tuple[str, ...]:
    """The architectures of ``target`` (an HFTarget / FastTarget or an HF model): its config's, or
    the model's class name where the config has none (a GGUF-loaded model: ``architectures`` None)."""
    if target is None:
        return ()
    model = getattr(target, "model", target)
    archs = getattr(getattr(model, "config", None), "architectures", None)
    if archs:
        return tuple(archs)
    return (type(model).__name__,) if hasattr(model, "get_output_embeddings") else ()


def with_verifier(p: Portable, *, target: Any = None, verifier: str | Path | None = None) -> Portable:
    """``p`` naming its verifier as a reference format records it: ``verifier`` (a hub id or HF
    folder) over the ``target``'s name (``target.name``: a dspark alias becomes its hub id) over what
    the source recorded; the architectures from the target's model, else the ``verifier`` folder's
    config.json, else the source's."""
    name, archs = p.verifier, p.verifier_architectures
    if target is not None:
        name = getattr(target, "name", None) or name
        archs = target_architectures(target) or archs
    if verifier is not None:
        name = str(verifier)
        if target is None:
            archs = tuple(_verifier_config(name, None).get("architectures") or ()) or archs
    return evolve(p, verifier=name, verifier_architectures=archs)


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------


def _refuse_unrepresentable(p: Portable, fmt: str) -> None:
    c = p.config
    reasons = []
    if _spec_arch(c.kind) is None:
        reasons.append(f"it is a {c.kind} drafter, a kind no reference format holds (its DrafterKind has no "
                       "speculators architecture; eagle3-fused is dspark's pre-reference Eagle3 layout)")
    if c.head == "silu-markov":
        reasons.append("its silu-markov head is dspark's pre-reference variant, which no reference format holds")
    if c.kind in ("dspark", "dflash") and c.mask_token_id is None:
        reasons.append(f"it has a learned mask vector; the {fmt} format embeds mask slots with a target token's embedding")
    if not c.layer.qk_norm:
        reasons.append(f"its draft layers lack q/k norm; the {fmt} format's draft layers are Qwen3 layers")
    if c.draft_vocab_size is not None and fmt == "deepspec":
        reasons.append("it has a reduced draft vocabulary, which DeepSpec's checkpoints do not hold (the speculators "
                       "format does: d2t / t2d)")
    if fmt == "speculators" and c.head in ("gated-markov", "rnn"):
        reasons.append(f"vLLM serves only the vanilla head, so a {c.head} head goes to the deepspec format only")
    if fmt == "deepspec" and not c.sample_from_anchor:
        reasons.append("it is a z-lab DFlash (drafts from the mask slots only), which DeepSpec's DFlash cannot express")
    if fmt == "deepspec" and not p.verifier_layers_known:
        reasons.append("the source does not record the verifier's layer count (num_target_layers); pass the target")
    if fmt == "deepspec" and c.kind == "eagle3" and len(c.target_layer_ids) != 5:
        reasons.append("DeepSpec's Eagle3 needs exactly five target layers")
    missing = [k for k in TARGET_KEYS if k not in p.weights]
    if missing:
        reasons.append(f"the {fmt} format stores the target's embedding and LM head, and this source has none "
                       "(a dspark checkpoint: pass the target it was trained for)")
    if reasons:
        raise FormatError(f"cannot write this {c.kind} drafter in the {fmt} format: " + "; ".join(reasons))


def _deepspec_config(p: Portable) -> dict[str, Any]:
    c = p.config
    out = {"architectures": ["Qwen3Eagle3Model" if c.kind == "eagle3" else "Qwen3DSparkModel"],
           **_layer_config(c.layer, c.num_layers, c.vocab_size, p.max_positions),
           "dtype": _dtype_name(p.weights), "num_target_layers": c.target.num_layers,
           "target_layer_ids": list(c.target_layer_ids)}
    if c.kind == "eagle3":
        out.update(draft_num_hidden_layers=c.num_layers, step_loss_decay=0.8,
                   target_model_name_or_path=_verifier_name(p, "DeepSpec's target_model_name_or_path"),
                   ttt_length=c.gamma)
    else:
        out.update(block_size=c.gamma, mask_token_id=c.mask_token_id, num_anchors=512,
                   enable_confidence_head=c.confidence, markov_rank=c.rank if c.head else 0)
        if c.head:
            out.update(markov_head_type=_HEAD_NAMES[c.head], confidence_head_with_markov=True)
    kept = p.extras.get("deepspec", {})  # the source's training fields (num_anchors, …) over the defaults
    out.update({k: kept[k] for k in _DEEPSPEC_EXTRAS if k in kept})
    return dict(sorted(out.items()))


def _verifier_name(p: Portable, field_name: str) -> str:
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


def _verifier_fields(p: Portable) -> dict[str, Any]:
    """speculators_config.verifier: a name that resolves and the verifier's real architectures."""
    name = _verifier_name(p, "speculators_config.verifier.name_or_path")
    archs = list(p.verifier_architectures) or _verifier_config(name, p.path).get("architectures")
    if not archs:
        raise FormatError(f"cannot write speculators_config.verifier.architectures: nothing records the "
                          f"architecture of verifier {name!r}; pass --target, or --verifier with an HF folder "
                          "holding its config.json")
    return {"architectures": list(archs), "name_or_path": name}


def _speculators_config(p: Portable) -> dict[str, Any]:
    c = p.config
    verifier = _verifier_fields(p)
    out: dict[str, Any] = {
        "architectures": [_spec_arch(c.kind)],
        "auto_map": {"": f"config.{ {'dspark': 'DSpark', 'dflash': 'DFlash', 'eagle3': 'Eagle3'}[c.kind]}SpeculatorConfig"},
        "draft_vocab_size": c.vocab_size if c.draft_vocab_size is None else c.draft_vocab_size - 1,
        "dtype": _dtype_name(p.weights),
        "speculators_config": {"algorithm": c.kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": c.gamma, "verifier_accept_k": 1}],
                               "verifier": verifier},
        "speculators_model_type": c.kind, "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None, "tie_word_embeddings": False,
        "transformer_layer_config": _layer_config(c.layer, c.num_layers, c.vocab_size, p.max_positions),
        "transformers_version": _transformers_version(),
    }
    speculators_ids = [i + 1 for i in c.target_layer_ids]  # speculators / vLLM index hidden_states
    if c.kind == "eagle3":
        out.update(eagle_aux_hidden_state_layer_ids=speculators_ids, embed_requires_grad=False, fc_norm=False,
                   norm_before_fc=False, norm_before_residual=False, norm_output=False)
    else:
        out.update(aux_hidden_state_layer_ids=speculators_ids,
                   block_size=c.gamma + (0 if c.sample_from_anchor else 1), mask_token_id=c.mask_token_id,
                   sample_from_anchor=c.sample_from_anchor, sliding_window_non_causal=False)
        if c.kind == "dspark":
            out.update(markov_rank=c.rank, markov_head_type=_HEAD_NAMES[c.head], enable_confidence_head=c.confidence,
                       confidence_head_with_markov=True)
    if p.extras:
        out[EXTRAS_KEY] = p.extras  # what speculators has no field for (DeepSpec's num_anchors, …)
    return dict(sorted(out.items()))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _dspark_files(p: Portable, out: Path) -> None:
    from safetensors.torch import save_file

    from dspark import __version__

    state = from_reference_keys(p.config.kind, {k: v for k, v in p.weights.items() if k not in TARGET_KEYS})
    if p.config.mask_token_id is not None:
        state.pop("mask_embedding", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS_NAME), metadata={"format": "dspark.drafter"})
    meta = {"format": "dspark.drafter", "format_version": FORMAT_VERSION, "dspark_version": __version__,
            "config": p.config.to_dict(), "converted_from": p.source_format}
    if p.extras:
        meta["reference_fields"] = p.extras
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def _reference_config(p: Portable, fmt: str) -> dict[str, Any]:
    _refuse_unrepresentable(p, fmt)
    return _deepspec_config(p) if fmt == "deepspec" else _speculators_config(p)


def _reference_files(p: Portable, out: Path, fmt: str, cfg: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    weights = p.weights
    if p.config.draft_vocab_size is not None:  # dspark's draft slots → speculators' d2t / t2d
        weights = to_speculators_vocab(weights, p.config.vocab_size)
    state, seen = {}, set()
    for k, v in weights.items():
        if k == "mask_embedding":
            continue
        v = v.contiguous()
        if v.data_ptr() in seen:  # a tied target (embedding = LM head): the formats store both tensors
            v = v.clone()
        seen.add(v.data_ptr())
        state[k] = v
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})  # as transformers' save_pretrained
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")


def write(p: Portable, fmt: str, out: str | Path, *, overwrite: bool = False,
          sources: tuple[str | Path, ...] = ()) -> Path:
    """Write ``p`` as a ``fmt`` checkpoint folder ``out``, all or nothing: the files go to a
    temporary sibling folder that replaces ``out`` only once complete. ``out`` is replaced only
    if it is empty or dspark wrote it, and never if it is, or holds, one of ``sources``
    (:mod:`dspark.outdir`)."""
    from dspark.outdir import OutputError, build_beside, check_replaceable, swap_in

    if fmt not in ("dspark", "deepspec", "speculators"):
        raise FormatError(f"cannot write format {fmt!r}; writable: dspark, deepspec, speculators")
    if fmt != "dspark":
        _refuse_unrepresentable(p, fmt)  # before touching the disk
    try:
        out = check_replaceable(out, overwrite=overwrite, sources=sources)
    except OutputError as err:
        raise FormatError(str(err)) from None
    check_tensors(p, p.path / WEIGHTS_NAME if p.path is not None else Path(f"<{p.source_format} checkpoint>"))
    cfg = _reference_config(p, fmt) if fmt != "dspark" else {}  # the verifier's refusals, before the disk
    tmp = build_beside(out)
    try:
        if fmt == "dspark":
            _dspark_files(p, tmp)
        else:
            _reference_files(p, tmp, fmt, cfg)
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert(src: str | Path, to: str, out: str | Path, *, target: Any = None, overwrite: bool = False,
            verifier: str | Path | None = None) -> Path:
    """Convert checkpoint folder ``src`` (any readable format) to format ``to`` in ``out``.

    A dspark-format source needs ``target`` to write a reference format (those store the target's
    embedding and LM head); reference ⇄ reference conversion copies the tensors untouched.
    ``verifier`` (a hub id or an HF folder) is the verifier the output names
    (:func:`with_verifier`); the speculators format refuses a source that names none.
    """
    from dspark.outdir import OutputError, check_replaceable

    try:  # before reading anything: the output must be one dspark may write
        check_replaceable(out, overwrite=overwrite, sources=(src,))
    except OutputError as err:
        raise FormatError(str(err)) from None
    p = read(src)
    if p.source_format == "dspark" and to != "dspark" and target is not None:
        drafter = build(p, target)
        p = evolve(portable_from_drafter(drafter, target), extras=p.extras)
    elif target is not None:
        p = evolve(p, config=_check_verifier(p, target), verifier_layers_known=True)
    return write(with_verifier(p, target=target, verifier=verifier), to, out, overwrite=overwrite, sources=(src,))
