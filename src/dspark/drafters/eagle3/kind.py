"""Eagle3's kind objects: the reference layout (``eagle3``: DeepSpec's ``Qwen3Eagle3Model``,
speculators' ``Eagle3DraftModel``) and dspark's pre-reference layout (``eagle3-fused``, format_version
1 checkpoints, which no reference format holds). Both are one family: a checkpoint of either loads
where the other is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dspark.drafters.config import DrafterConfig
from dspark.drafters.formats.portable import FormatError, verifier_name
from dspark.drafters.kinds import NeuralKind

__all__ = ["Eagle3Kind", "FusedEagle3Kind", "EAGLE3_KIND", "EAGLE3_FUSED_KIND"]

# the llama-style EAGLE-3 variant's flags (speculators), which the DeepSpec layout has none of
_LLAMA_STYLE_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


@attrs.frozen
class Eagle3Kind(NeuralKind):
    """The reference Eagle3: its module carries the reference tensor names (no key map)."""

    def refusals(self, config: Any, fmt: str) -> list[str]:
        reasons = super().refusals(config, fmt)
        if fmt == "deepspec" and len(config.target_layer_ids) != 5:
            reasons.append("DeepSpec's Eagle3 needs exactly five target layers")
        return reasons

    def speculators_fields(self, config: Any) -> dict[str, Any]:
        return {"embed_requires_grad": False, **{flag: False for flag in _LLAMA_STYLE_FLAGS}}

    def deepspec_fields(self, portable: Any) -> dict[str, Any]:
        c = portable.config
        return {"architectures": ["Qwen3Eagle3Model"], "draft_num_hidden_layers": c.num_layers,
                "step_loss_decay": 0.8,
                "target_model_name_or_path": verifier_name(portable, "DeepSpec's target_model_name_or_path"),
                "ttt_length": c.gamma}

    def from_speculators(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                         where: Path) -> DrafterConfig:
        layer = cfg["transformer_layer_config"]
        methods = cfg["speculators_config"].get("proposal_methods") or [{}]
        flags = [f for f in _LLAMA_STYLE_FLAGS if cfg.get(f)]
        if flags:
            raise FormatError(f"{where}: Eagle3 with {', '.join(flags)} is the llama-style EAGLE-3 variant, not "
                              "the DeepSpec layout dspark implements")
        return DrafterConfig(kind=self.name, vocab_size=layer["vocab_size"], layer=shape, target=target,
                             target_layer_ids=tuple(layer_ids), num_layers=layer["num_hidden_layers"],
                             gamma=int(methods[0].get("speculative_tokens", 7)))

    def from_deepspec(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                      where: Path) -> DrafterConfig:
        return DrafterConfig(kind=self.name, vocab_size=cfg["vocab_size"], layer=shape, target=target,
                             target_layer_ids=tuple(layer_ids), num_layers=cfg["num_hidden_layers"],
                             gamma=int(cfg.get("ttt_length", 7)))


@attrs.frozen
class FusedEagle3Kind(NeuralKind):
    """dspark's pre-reference Eagle3 layout: no reference format holds it."""

    def refusals(self, config: Any, fmt: str) -> list[str]:
        return [f"it is a {self.name} drafter, a kind no reference format holds (its DrafterKind has no "
                f"speculators architecture; {self.name} is dspark's pre-reference Eagle3 layout)"]


_EAGLE3_RECIPE = {
    "train_forward": "dspark.drafters.eagle3.training:eagle3_forward",
    "train_loss": "dspark.drafters.eagle3.training:Eagle3Loss",
    "loss_weights": {"lambda_ce": 0.0, "lambda_l1": 0.0, "lambda_conf": 0.0, "lambda_soft_ce": 1.0},
}

EAGLE3_KIND = Eagle3Kind(
    "eagle3", "Eagle3 (DeepSpec layout): one autoregressive layer over the fused target features.",
    "dspark.drafters.eagle3.model:Eagle3Drafter", defaults={"num_layers": 1}, fixed_num_layers=1,
    speculators_arch="Eagle3DraftModel", speculators_layer_ids_field="eagle_aux_hidden_state_layer_ids",
    deepspec_arch="Eagle3Model", family="eagle3", **_EAGLE3_RECIPE)

EAGLE3_FUSED_KIND = FusedEagle3Kind(
    "eagle3-fused", "legacy: dspark's pre-reference Eagle3 layout (format_version 1 checkpoints).",
    "dspark.drafters.eagle3.model:Eagle3FusedDrafter", defaults={"num_layers": 1}, num_target_layers=3,
    family="eagle3", format_v1_name="eagle3", **_EAGLE3_RECIPE)
