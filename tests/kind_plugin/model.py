"""``scaled-dflash``'s module and graphs: DFlash's, with the base logits times ``logit_scale``."""

import attrs
import torch
from torch import nn

from dspark.drafters.dflash.graphs import block_graph_specs
from dspark.drafters.dflash.model import BlockDrafter


class ScaledBackbone(nn.Module):
    """DFlash's backbone graph, its logits scaled."""

    def __init__(self, backbone: nn.Module, scale: nn.Parameter) -> None:
        super().__init__()
        self.backbone, self.scale = backbone, scale

    def forward(self, anchor_ids, positions, ctx_k, ctx_v, ctx_mask):
        h, logits = self.backbone(anchor_ids, positions, ctx_k, ctx_v, ctx_mask)
        return h, logits * self.scale.to(logits.dtype)


def scaled_graph_specs(drafter, live=False):
    return [attrs.evolve(spec, module=ScaledBackbone(spec.module, drafter.logit_scale))
            if spec.name == "backbone" else spec for spec in block_graph_specs(drafter, live)]


class ScaledBlockDrafter(BlockDrafter):
    graph_specs = staticmethod(scaled_graph_specs)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.logit_scale = nn.Parameter(torch.ones(()))

    def refine(self, prev, h, U):
        return U * self.logit_scale.to(U.dtype), None
