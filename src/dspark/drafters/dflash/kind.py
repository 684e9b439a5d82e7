"""DFlash's kind object: its config rules, module, training recipe and checkpoint rules.

:class:`BlockKind` states what every block drafter (DFlash, and DSpark which extends it) writes to
and reads from the reference formats; DeepSpec holds a DFlash as its DSpark model without a
sequential head (``markov_rank`` 0), speculators as ``DFlashDraftModel``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dspark.drafters.dflash.formats import NAME, block_config
from dspark.drafters.formats.portable import need
from dspark.drafters.kinds import KeyMap, NeuralKind

__all__ = ["BlockKind", "BACKBONE_KEYS", "DFLASH_KIND"]

#: the backbone's tensor names (``BlockDrafter``) ⇄ the reference's; {i} stands for a layer index
BACKBONE_KEYS = KeyMap([
    ("fuse.", "fc."),
    ("fuse_norm.", "hidden_norm."),
    *[(f"layers.{{i}}.{n}.", f"layers.{{i}}.self_attn.{n}.") for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "q_norm", "k_norm")],
    *[(f"layers.{{i}}.{n}.", f"layers.{{i}}.mlp.{n}.") for n in ("gate_proj", "up_proj", "down_proj")],
    ("layers.{i}.input_norm.", "layers.{i}.input_layernorm."),
    ("layers.{i}.post_norm.", "layers.{i}.post_attention_layernorm."),
])


@attrs.frozen
class BlockKind(NeuralKind):
    """A block drafter kind: the parallel backbone, mask slots embedded with a target token."""

    #: speculators' ``sample_from_anchor`` when a config omits it (DFlash's default layout is z-lab's)
    speculators_sample_from_anchor: bool = False

    def refusals(self, config: Any, fmt: str) -> list[str]:
        reasons = super().refusals(config, fmt)
        if config.mask_token_id is None:
            reasons.append(f"it has a learned mask vector; the {fmt} format embeds mask slots with a target "
                           "token's embedding")
        if fmt == "deepspec" and not config.sample_from_anchor:
            reasons.append("it is a z-lab DFlash (drafts from the mask slots only), which DeepSpec's DFlash "
                           "cannot express")
        return reasons

    def speculators_fields(self, config: Any) -> dict[str, Any]:
        return {"block_size": config.gamma + (0 if config.sample_from_anchor else 1),
                "mask_token_id": config.mask_token_id, "sample_from_anchor": config.sample_from_anchor,
                "sliding_window_non_causal": False}

    def deepspec_fields(self, portable: Any) -> dict[str, Any]:
        c = portable.config
        return {"architectures": ["Qwen3DSparkModel"], "block_size": c.gamma, "mask_token_id": c.mask_token_id,
                "num_anchors": 512, "enable_confidence_head": c.confidence, "markov_rank": 0}

    def from_speculators(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                         where: Path) -> Any:
        need(cfg, where, "speculators", "block_size", "mask_token_id")
        sfa = bool(cfg.get("sample_from_anchor", self.speculators_sample_from_anchor))
        gamma = int(cfg["block_size"]) - (0 if sfa else 1)
        return self.reference_config({**cfg["transformer_layer_config"], **cfg}, shape, layer_ids, target,
                                     gamma, sfa, where)

    def reference_config(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any, gamma: int,
                         sample_from_anchor: bool, where: Path) -> Any:
        """The DrafterConfig of a reference block-drafter config (a kind with heads reads them too)."""
        return block_config(self.name, cfg, shape, layer_ids, target, gamma, sample_from_anchor, where)


DFLASH_KIND = BlockKind(
    NAME, "DFlash: the parallel backbone alone.", "dspark.drafters.dflash.model:BlockDrafter",
    defaults={"num_layers": 5}, uses_mask_token=True, anchorless=True,
    train_forward="dspark.drafters.dflash.training:block_forward",
    train_loss="dspark.drafters.dflash.training:BlockLoss",
    loss_weights={"lambda_ce": 1.0, "lambda_l1": 0.0, "lambda_conf": 0.0},
    speculators_arch="DFlashDraftModel", key_map=BACKBONE_KEYS)
