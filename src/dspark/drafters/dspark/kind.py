"""DSpark's kind object: DFlash's rules (:class:`~dspark.drafters.dflash.kind.BlockKind`) plus
the sequential head's and the confidence head's.

In DeepSpec and speculators a DSpark carries ``markov_rank``, ``markov_head_type`` (``vanilla`` /
``gated`` / ``rnn``) and ``enable_confidence_head``; DeepSpec's DSpark model without a head
(``markov_rank`` 0) is its DFlash, read as kind ``dflash``. vLLM serves only the vanilla head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dspark.drafters.dflash.formats import block_config
from dspark.drafters.dflash.kind import BACKBONE_KEYS, DFLASH_KIND, BlockKind
from dspark.drafters.formats.portable import FormatError, need
from dspark.drafters.kinds import KeyMap

__all__ = ["DSparkKind", "HEAD_KEYS", "HEAD_NAMES", "DSPARK_KIND"]

#: the heads' tensor names ⇄ the reference's
HEAD_KEYS = KeyMap([
    ("head.w_down.", "markov_head.markov_w1."),
    ("head.w_up.", "markov_head.markov_w2."),
    ("head.w_g.", "markov_head.gate_proj."),
    ("head.w.", "markov_head.joint_proj."),
])
#: dspark's head names ↔ the reference's ``markov_head_type``
HEAD_NAMES = {"vanilla-markov": "vanilla", "gated-markov": "gated", "rnn": "rnn"}


@attrs.frozen
class DSparkKind(BlockKind):
    """The block drafter with a sequential head and a confidence head."""

    def refusals(self, config: Any, fmt: str) -> list[str]:
        reasons = []
        if config.head == "silu-markov":
            reasons.append("its silu-markov head is dspark's pre-reference variant, which no reference format holds")
        reasons += super().refusals(config, fmt)
        if fmt == "speculators" and config.head in ("gated-markov", "rnn"):
            reasons.append(f"vLLM serves only the vanilla head, so a {config.head} head goes to the deepspec "
                           "format only")
        return reasons

    def speculators_fields(self, config: Any) -> dict[str, Any]:
        return {**super().speculators_fields(config), "markov_rank": config.rank,
                "markov_head_type": HEAD_NAMES[config.head], "enable_confidence_head": config.confidence,
                "confidence_head_with_markov": True}

    def deepspec_fields(self, portable: Any) -> dict[str, Any]:
        c = portable.config
        out = super().deepspec_fields(portable)
        if c.head:
            out.update(markov_rank=c.rank, markov_head_type=HEAD_NAMES[c.head], confidence_head_with_markov=True)
        return out

    def from_deepspec(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                      where: Path) -> Any:
        need(cfg, where, "DeepSpec", "block_size", "mask_token_id")
        return self.reference_config(cfg, shape, layer_ids, target, int(cfg["block_size"]), True, where)

    def reference_config(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any, gamma: int,
                         sample_from_anchor: bool, where: Path) -> Any:
        head = None
        if int(cfg.get("markov_rank") or 0):
            htype = cfg.get("markov_head_type", "vanilla")
            names = {v: k for k, v in HEAD_NAMES.items()}
            if htype not in names:
                raise FormatError(f"{where}: markov_head_type {htype!r} is not one of {sorted(names)}")
            head = names[htype]
        if not head:  # DeepSpec's DFlash: the same class with markov_rank 0
            return block_config(DFLASH_KIND.name, cfg, shape, layer_ids, target, gamma, sample_from_anchor, where,
                                confidence=False)
        return block_config(self.name, cfg, shape, layer_ids, target, gamma, sample_from_anchor, where, head=head)


DSPARK_KIND = DSparkKind(
    "dspark", "DSpark: parallel backbone + sequential head + confidence head.",
    "dspark.drafters.dspark.model:DSparkDrafter",
    defaults={"num_layers": 5, "head": "vanilla-markov", "confidence": True},
    uses_mask_token=True, has_head=True,
    train_forward="dspark.drafters.dflash.training:block_forward",
    train_loss="dspark.drafters.dflash.training:BlockLoss",
    speculators_arch="DSparkDraftModel", speculators_sample_from_anchor=True, deepspec_arch="DSparkModel",
    key_map=BACKBONE_KEYS + HEAD_KEYS)
