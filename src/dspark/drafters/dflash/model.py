"""DFlash's module: the parallel backbone every block drafter runs (DSpark adds its heads,
:mod:`dspark.drafters.dspark.model`).

Terms as in :mod:`dspark.drafters.neural`. One non-causal forward over the block
[anchor, MASK × (γ−1)] at positions a..a+γ−1 (the z-lab layout, ``sample_from_anchor`` False:
[anchor, MASK × γ], the anchor row predicting nothing) gives h_1..h_γ and base logits
U_j = W_lm·norm(h_j); DFlash draws every x̂_j from U_j.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.drafters.dflash.graphs import block_graph_specs
from dspark.drafters.dflash.round import block_round
from dspark.drafters.layers import DraftLayer, RMSNorm
from dspark.drafters.neural import NeuralDrafter

__all__ = ["BlockDrafter"]


class BlockDrafter(NeuralDrafter):
    """DFlash: fused target features injected as every draft layer's context K/V, the block
    through the draft layers in one parallel forward, the target's LM head."""

    round = staticmethod(block_round)
    graph_specs = staticmethod(block_graph_specs)

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        return ("context", "backbone")

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        s = config.layer
        m = len(config.target_layer_ids)
        self.fuse = nn.Linear(m * s.hidden_size, s.hidden_size, bias=False)
        self.fuse_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(config.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if config.mask_token_id is None:  # pre-reference variant: a learned mask vector
            self.mask_embedding = nn.Parameter(torch.zeros(s.hidden_size))
            nn.init.normal_(self.mask_embedding, std=0.02)
        self.head = None  # DSpark's sequential head and confidence head (dspark.drafters.dspark.model)
        self.confidence_head = None

    def mask_vector(self) -> torch.Tensor:
        """The embedding [d] of the block's mask slots: the target's (frozen) input embedding of
        ``mask_token_id`` as in the reference, or the learned vector of a pre-reference drafter."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        self._require_bound()
        return self._embed[self.config.mask_token_id].to(self.dtype)

    def refine(self, prev: torch.Tensor, h: torch.Tensor, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher-forced training logits from the backbone's (prev slots [B, γ], h [B, γ, d],
        U [B, γ, V_d]) → (logits [B, γ, V_d], confidence logits [B, γ] or None): U itself here."""
        return U, None
