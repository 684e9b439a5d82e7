"""The DrafterKind protocol: a kind of neural drafter (:mod:`dspark.drafters.kinds`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["DrafterKind"]


@runtime_checkable
class DrafterKind(Protocol):
    """A kind of neural drafter (see the module docstring)."""

    name: str
    loss_weights: Any  # TrainConfig overrides (the reference's loss for this kind)
    speculators_arch: str | None  # speculators' architecture name, None when vLLM cannot serve it
    reference_keys: bool  # whether tensors are renamed to the reference layout in exchange formats
    family_name: str  # kinds of one family load each other's checkpoints

    def validate(self, config: Any) -> None:
        """Raise ValueError when ``config`` breaks this kind's rules."""

    def config_defaults(self, num_target_layers: int, vocab_size: int) -> dict[str, Any]:
        """DrafterConfig fields the reference uses for a target with this many layers and tokens."""

    def layer_count(self, num_target_layers: int) -> int:
        """How many target layers the drafter reads by default."""

    def build(self, config: Any) -> Any:
        """The drafter module (``nn.Module``) for ``config``."""

    def graph_names(self, config: Any) -> tuple[str, ...]:
        """The graphs an export of ``config`` (a DrafterConfig dict) holds."""

    def drafting_round(self) -> Any:
        """The round function (:mod:`dspark.drafters.loop`) every runner uses for this kind."""

    def training_recipe(self) -> tuple[Any, Any]:
        """(forward, loss): ``forward(drafter, batch) → Targets``; ``loss(cfg, targets) →
        (total, {term: num}, den)`` (:mod:`dspark.training`)."""
