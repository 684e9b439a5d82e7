"""DFlash's checkpoint rules: the config of a block drafter read from a reference format, and
z-lab DFlash's own format (``dflash_config``), which drafts from the mask slots only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.drafters.config import DrafterConfig, TargetInfo
from dspark.drafters.formats.portable import (
    CONFIG_NAME,
    FormatError,
    Portable,
    check_ids,
    load_weights,
    need,
    shape_fields,
)
from dspark.drafters.layers import LayerShape

__all__ = ["NAME", "block_config", "read_zlab"]

NAME = "dflash"  # the kind's name


def block_config(kind: str, cfg: dict[str, Any], shape: LayerShape, ids: list[int], target: TargetInfo,
                 gamma: int, sample_from_anchor: bool, where: Path, *, head: str | None = None,
                 confidence: bool = True) -> DrafterConfig:
    """A ``kind`` block drafter's config from a reference config ``cfg`` (``markov_rank``,
    ``enable_confidence_head``, ``mask_token_id``, …); ``head``: its sequential head (DSpark's);
    ``confidence`` False drops the confidence head ``cfg`` asks for (once checked)."""
    rank = int(cfg.get("markov_rank") or 0)
    wants_confidence = bool(cfg.get("enable_confidence_head"))
    if wants_confidence and not cfg.get("confidence_head_with_markov", True):
        raise FormatError(f"{where}: a confidence head without the Markov embedding is not supported")
    return DrafterConfig(
        kind=kind, vocab_size=cfg["vocab_size"], layer=shape, target=target, target_layer_ids=tuple(ids),
        num_layers=cfg["num_hidden_layers"], gamma=gamma, head=head, rank=rank or 256,
        confidence=wants_confidence and confidence, mask_token_id=cfg.get("mask_token_id"),
        sample_from_anchor=sample_from_anchor,
    )


def read_zlab(root: Path, cfg: dict[str, Any]) -> Portable:
    """A z-lab DFlash folder (top-level Qwen3 config + ``dflash_config``) as a Portable."""
    where = root / CONFIG_NAME
    dcfg = cfg.get("dflash_config") or {}
    merged = {**cfg, **dcfg}
    need(merged, where, "z-lab DFlash", "target_layer_ids", "mask_token_id", "block_size", "vocab_size",
         "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    shape = shape_fields(cfg, where)
    ids = check_ids(list(merged["target_layer_ids"]), where, "target_layer_ids")
    n_known = cfg.get("num_target_layers")
    n_target = n_known or max(ids) + 2  # a lower bound when unrecorded
    target = TargetInfo(cfg.get("target_name") or "unknown", cfg["vocab_size"], cfg["hidden_size"], int(n_target))
    # z-lab drafts from the mask slots only: a block of B gives B − 1 drafts.
    config = block_config(NAME, {**cfg, "markov_rank": 0, "mask_token_id": merged["mask_token_id"]}, shape,
                          ids, target, int(merged["block_size"]) - 1, False, where)
    weights = {k.removeprefix("model."): v for k, v in load_weights(root).items()}
    return Portable(config, weights, cfg.get("target_name"), (), cfg.get("max_position_embeddings"),
                    "zlab-dflash", n_known is not None)
