"""DSpark's graphs: DFlash's parallel backbone (:mod:`dspark.drafters.dflash.graphs`) and one
sequential-head step.

Symbols as in :mod:`dspark.drafters.dflash.graphs`; r the head's rank.

    head      prev_ids [batch], h_j [batch, d], base_logits_j [batch, V] (+ state [batch, r], RNN)
                                                                        → logits [batch, V]
                                                                          (+ confidence_logit [batch])
                                                                          (+ state_out [batch, r])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.drafters.dflash.graphs import block_graph_specs
from dspark.drafters.dspark.rows import CachedHeadStep, caches_rows
from dspark.drafters.graphs import GraphSpec, example_inputs, static_last_dim

__all__ = ["HeadStepGraph", "head_is_stateful", "dspark_graph_specs"]


def head_is_stateful(head: Any) -> bool:
    """Whether a sequential head carries a state [R, r] from step to step (the RNN head)."""
    return bool(getattr(head, "stateful", getattr(head, "name", None) == "rnn"))


class HeadStepGraph(nn.Module):
    """One sequential-head step (+ the confidence head): Ũ_j = U_j + b(x̂_{j−1}, h_j)."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.head, self.confidence_head = drafter.head, drafter.confidence_head
        self.stateful = head_is_stateful(drafter.head)

    def forward(self, prev_ids: torch.Tensor, h_j: torch.Tensor, base_logits_j: torch.Tensor,
                state: torch.Tensor | None = None):
        logits, s = self.head.step(prev_ids, h_j, base_logits_j, state)
        outs = [logits]  # [B, V]
        if self.confidence_head is not None:
            outs.append(self.confidence_head(h_j, self.head.prev_embedding(prev_ids)))  # [B]
        if self.stateful:
            outs.append(static_last_dim(s))  # [B, r]
        return tuple(outs)


def dspark_graph_specs(drafter: Any, live: bool = False) -> list[GraphSpec]:
    """DSpark's graphs (``context``, ``backbone``, and ``head`` with a sequential head), with
    example inputs for tracing."""
    examples = example_inputs(drafter)
    c, s, B, new, P, gen, randn, mask = examples
    d = s.hidden_size
    specs = block_graph_specs(drafter, live, examples)
    if drafter.head is not None:
        stateful = head_is_stateful(drafter.head)
        keep_rows = live and not stateful and caches_rows(drafter.head, next(drafter.parameters()).device)
        # the cached step has the same inputs and outputs, its correction rows kept
        graph = CachedHeadStep(drafter) if keep_rows else HeadStepGraph(drafter)
        inputs = ["prev_ids", "h_j", "base_logits_j"]
        outputs = ["logits"]
        Vd = drafter.draft_size  # the head works in draft slots (V_d = V without a reduced vocabulary)
        example = [torch.randint(0, Vd, (B,), generator=gen), randn(B, d), randn(B, Vd)]
        axes = {"prev_ids": {0: "batch"}, "h_j": {0: "batch"}, "base_logits_j": {0: "batch"},
                "logits": {0: "batch"}}
        if drafter.confidence_head is not None:
            outputs.append("confidence_logit")
            axes["confidence_logit"] = {0: "batch"}
        if stateful:
            inputs.append("state")
            outputs.append("state_out")
            example.append(randn(B, c.rank))
            axes.update(state={0: "batch"}, state_out={0: "batch"})
        specs.append(GraphSpec("head", "one sequential-head step (+ confidence), γ per round",
                               graph, tuple(inputs), tuple(outputs), axes, tuple(example)))
    return specs
