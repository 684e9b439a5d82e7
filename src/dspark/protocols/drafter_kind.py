"""The DrafterKind protocol: a kind of neural drafter (:mod:`dspark.drafters.kinds`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["DrafterKind"]


@runtime_checkable
class DrafterKind(Protocol):
    """A kind of neural drafter (see the module docstring of :mod:`dspark.drafters.kinds`)."""

    name: str
    loss_weights: Any  # TrainConfig overrides (the reference's loss for this kind)
    speculators_arch: str | None  # speculators' architecture name, None when vLLM cannot serve it
    speculators_layer_ids_field: str  # the speculators config field naming the target layers
    deepspec_arch: str | None  # the DeepSpec architecture suffix this kind reads, None: none
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
        """(forward, loss): ``forward(drafter, batch) → Targets``; ``loss.terms(cfg, targets) →
        (total, {term: num}, den, per-position)`` (:mod:`dspark.training`)."""

    def to_reference_keys(self, state: Any) -> dict[str, Any]:
        """Module tensor names → the reference checkpoint's."""

    def from_reference_keys(self, state: Any) -> dict[str, Any]:
        """Reference tensor names → the module's."""

    def refusals(self, config: Any, fmt: str) -> list[str]:
        """Why reference format ``fmt`` cannot hold a drafter of ``config`` (kind rules only)."""

    def speculators_fields(self, config: Any) -> dict[str, Any]:
        """This kind's fields of a speculators config.json."""

    def deepspec_fields(self, portable: Any) -> dict[str, Any]:
        """This kind's fields of a DeepSpec config.json."""

    def from_speculators(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                         where: Any) -> Any:
        """The DrafterConfig a speculators config of this kind describes."""

    def from_deepspec(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                      where: Any) -> Any:
        """The DrafterConfig a DeepSpec config of this kind's architecture describes."""
