"""The ``scaled-dflash`` kind: DFlash's backbone with a learned temperature on its logits."""

from dspark.drafters.dflash.kind import BACKBONE_KEYS
from dspark.drafters.kinds import KeyMap, NeuralKind

SCALED_KIND = NeuralKind(
    "scaled-dflash", "DFlash whose logits are scaled by a learned factor (a test plugin's kind).",
    "kind_plugin.model:ScaledBlockDrafter",
    defaults={"num_layers": 1}, uses_mask_token=True,
    train_forward="dspark.drafters.dflash.training:block_forward",
    train_loss="dspark.drafters.dflash.training:BlockLoss",
    loss_weights={"lambda_ce": 1.0, "lambda_l1": 0.0, "lambda_conf": 0.0},
    key_map=BACKBONE_KEYS + KeyMap([("logit_scale", "lm_temperature")]),
)
