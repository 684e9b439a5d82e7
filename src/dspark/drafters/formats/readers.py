"""Reading a checkpoint folder in any format into a :class:`~dspark.drafters.formats.portable.Portable`:
detecting the format from ``config.json``, the fields every format shares, and — for the reference
formats — the drafter kind's own fields, read by its kind object (``from_deepspec``,
``from_speculators``); z-lab DFlash is DFlash's own format (:mod:`dspark.drafters.dflash.formats`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import evolve

from dspark.drafters.config import TargetInfo
from dspark.drafters.files import CheckpointError, _dspark_config, _read_json
from dspark.drafters.formats.portable import (
    CONFIG_NAME,
    DEEPSPEC_EXTRAS,
    EXTRAS_KEY,
    WEIGHTS_NAME,
    FormatError,
    Portable,
    check_ids,
    load_weights,
    need,
    read_extras,
    shape_fields,
    to_reference_keys,
    verifier_layers,
)
from dspark.drafters.kinds import drafter_kind, kind_names
from dspark.drafters.speculators_vocab import from_speculators_vocab

__all__ = ["FORMATS", "detect", "read"]

FORMATS = ("dspark", "deepspec", "speculators", "zlab-dflash")


def _deepspec_archs() -> dict[str, str]:
    """DeepSpec architecture suffix → the kind that reads it (``DrafterKind.deepspec_arch``)."""
    out: dict[str, str] = {}
    for name in kind_names():
        arch = drafter_kind(name).deepspec_arch
        if arch:
            out.setdefault(arch, name)
    return out


def _lacks(cfg: dict[str, Any]) -> dict[str, str]:
    """For each format, the field it needs that ``cfg`` lacks ('' where it matches)."""
    archs = " ".join(cfg.get("architectures") or [])
    deepspec = _deepspec_archs()
    return {
        "dspark": "" if cfg.get("format") == "dspark.drafter" else "'format': 'dspark.drafter'",
        "speculators": "" if "speculators_model_type" in cfg else "'speculators_model_type'",
        "deepspec": "" if ("target_layer_ids" in cfg and any(a in archs for a in deepspec))
        else "'target_layer_ids' with architectures " + " / ".join(f"*{a}" for a in deepspec),
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


def _read_deepspec(root: Path, cfg: dict[str, Any]) -> Portable:
    where = root / CONFIG_NAME
    need(cfg, where, "DeepSpec", "target_layer_ids", "vocab_size", "hidden_size", "num_hidden_layers",
         "num_attention_heads", "intermediate_size")
    arch = " ".join(cfg.get("architectures") or [])
    shape = shape_fields(cfg, where)
    ids = check_ids(list(cfg["target_layer_ids"]), where, "target_layer_ids")
    n_target = cfg.get("num_target_layers") or verifier_layers(cfg.get("target_model_name_or_path"), root)
    if n_target is None:
        raise FormatError(f"{where}: DeepSpec config lacks num_target_layers")
    verifier = cfg.get("target_model_name_or_path")  # Eagle3 configs only
    target = TargetInfo(verifier or "unknown", cfg["vocab_size"], cfg["hidden_size"], int(n_target))
    kind = next((k for a, k in _deepspec_archs().items() if a in arch), None)
    if kind is None:
        raise FormatError(f"{where}: no drafter kind reads DeepSpec architecture {arch!r}")
    config = drafter_kind(kind).from_deepspec(cfg, shape, ids, target, where)
    kept = {k: cfg[k] for k in DEEPSPEC_EXTRAS if k in cfg}
    extras = {"deepspec": kept} if kept else {}
    return Portable(config, load_weights(root), verifier, (), cfg.get("max_position_embeddings"), "deepspec",
                    extras=extras)


def _read_speculators(root: Path, cfg: dict[str, Any]) -> Portable:
    where = root / CONFIG_NAME
    kind = cfg["speculators_model_type"]
    servable = [k for k in kind_names() if drafter_kind(k).speculators_arch]
    if kind not in servable:
        raise FormatError(f"{where}: speculators_model_type {kind!r} is not one of {servable}")
    spec_kind = drafter_kind(kind)
    need(cfg, where, "speculators", "transformer_layer_config", "speculators_config")
    layer = cfg["transformer_layer_config"]
    shape = shape_fields(layer, where)
    spec = cfg["speculators_config"]
    verifier = spec.get("verifier") or {}
    ids_field = spec_kind.speculators_layer_ids_field
    need(cfg, where, "speculators", ids_field)
    ids = check_ids([i - 1 for i in cfg[ids_field]], where, ids_field)
    name = verifier.get("name_or_path")
    n_known = verifier_layers(name, root)
    n_target = n_known or max(ids) + 2  # a lower bound; replaced by the target's own count when loading
    target = TargetInfo(str(name or "unknown"), layer["vocab_size"], layer["hidden_size"], n_target)
    weights = load_weights(root)
    draft_vocab, V = int(cfg.get("draft_vocab_size") or layer["vocab_size"]), layer["vocab_size"]
    if not 2 <= draft_vocab <= V:
        raise FormatError(f"{where}: draft_vocab_size {draft_vocab} is not in [2, the verifier's vocabulary {V}]")
    if draft_vocab < V:  # d2t / t2d → dspark's draft slots (draft_ids, the placeholder slot)
        weights = from_speculators_vocab(weights, V, draft_vocab, root / WEIGHTS_NAME)
    elif "d2t" in weights:  # a full vocabulary may still ship the identity map
        if weights["d2t"].any():
            raise FormatError(f"{where}: draft_vocab_size equals the vocabulary ({V}) but d2t is not the identity")
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    config = spec_kind.from_speculators(cfg, shape, ids, target, where)
    if draft_vocab < V:
        config = evolve(config, draft_vocab_size=draft_vocab + 1)
    return Portable(config, weights, str(name) if name else None, tuple(verifier.get("architectures") or ()),
                    layer.get("max_position_embeddings"), "speculators", n_known is not None,
                    extras=read_extras(cfg.get(EXTRAS_KEY), where))


def _read_zlab(root: Path, cfg: dict[str, Any]) -> Portable:
    from dspark.drafters.dflash.formats import read_zlab

    return read_zlab(root, cfg)


def _read_dspark(root: Path, cfg: dict[str, Any]) -> Portable:
    config = _dspark_config(cfg, root / CONFIG_NAME)
    state = load_weights(root)
    return Portable(config, to_reference_keys(config.kind, state), config.target.name, (), None, "dspark",
                    extras=read_extras(cfg.get("reference_fields"), root / CONFIG_NAME))


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
