"""DSpark's module: DFlash's parallel backbone (:class:`~dspark.drafters.dflash.model.BlockDrafter`)
plus a sequential head and a confidence head.

After the backbone's h_1..h_γ and base logits U_j, the sequential head gives
Ũ_j = U_j + b(x̂_{j−1}, h_j) for j = 1..γ and x̂_j ~ softmax(Ũ_j) under the request's sampling
params, with confidence logits from (h_j, x̂_{j−1}).
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.drafters.config import DrafterConfig
from dspark.drafters.dflash.model import BlockDrafter
from dspark.drafters.dspark.graphs import dspark_graph_specs, head_is_stateful
from dspark.drafters.dspark.round import dspark_round
from dspark.protocols.sequential_head import TargetBoundHead

__all__ = ["DSparkDrafter"]


class DSparkDrafter(BlockDrafter):
    """DSpark (with ``config.head``; without one it drafts as DFlash does)."""

    round = staticmethod(dspark_round)
    graph_specs = staticmethod(dspark_graph_specs)
    # the sequential head is left out of the round's floor: a Markov head's correction rows come
    # from a cache once its previous tokens were seen (dspark.drafters.dspark.rows), so a round may
    # read none of its weights, and its tables are read by row (an RNN head's products are then
    # per-step cost above the floor)
    round_may_skip = ("head",)

    @staticmethod
    def graph_names(config: dict[str, Any]) -> tuple[str, ...]:
        return ("context", "backbone", "head") if config.get("head") else ("context", "backbone")

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        if config.head is None:
            return
        from dspark.heads import HEAD_KINDS, ConfidenceHead, build_head

        s = config.layer
        if config.head in HEAD_KINDS:
            self.head = build_head(config.head, self.draft_size, s.hidden_size, config.rank)
        else:  # a plugin's head (register_sequential_heads), same factory signature
            from dspark.plugins import create

            self.head = create("sequential_heads", config.head, vocab_size=self.draft_size,
                               hidden_size=s.hidden_size, rank=config.rank)
        if config.confidence:
            self.confidence_head = ConfidenceHead(s.hidden_size, config.rank)

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DSparkDrafter:
        super().bind_target(embed_weight, lm_head_weight)
        if isinstance(self.head, TargetBoundHead):
            # A head that reuses the target's weights gets them in its own (draft-slot) order.
            embed = self._embed if self.vocab_map is None else self._embed[self.draft_ids]  # [V_d, d]
            self.head.bind_target(embed, self._lm_head)
        return self

    def _head_fields(self) -> dict[str, Any]:
        head = self.head
        return {"head": self.config.head if head is not None else None,
                "confidence": self.confidence_head is not None,
                "stateful_head": head is not None and head_is_stateful(head)}

    def refine(self, prev: torch.Tensor, h: torch.Tensor, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced: Ũ = U + b(x_{a+j}, h_j) (the true previous tokens ``prev``) and the
        confidence logits from (h_j, x_{a+j})."""
        if self.head is None:
            return U, None
        U = self.head(prev, h, U)  # Ũ [B, γ, V_d]
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(h, self.head.prev_embedding(prev))  # [B, γ]
        return U, conf
