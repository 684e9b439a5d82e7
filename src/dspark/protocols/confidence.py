"""ConfidenceModel: raw per-position confidence logits for a draft block."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dspark.types import DraftBlock


@runtime_checkable
class ConfidenceModel(Protocol):
    """Produces raw confidence logits [R, γ] for a draft block.

    Losslessness (docs/concepts.md §5): the logit at position j may read h_j, q_j and x̂_{j-1}, never the
    draft token x̂_j itself nor any later position.

    ``calibrated`` is True when the logits are calibrated as they come (σ(logit) is the per-step
    acceptance probability, as a model fitted by log-loss on held-out rounds gives): the engine then
    refuses a calibrator other than ``identity``, which would calibrate them twice.

    Optional: ``passes_head_logits`` True when the logits are the block's ``confidence_logits`` as
    the drafter's confidence head gave them, step by step: the round may then end a draft while it
    is drawn (:func:`dspark.round.schedule_stop`).
    """

    name: str
    calibrated: bool

    def confidence_logits(self, block: DraftBlock) -> torch.Tensor: ...
