"""Drafter kinds as plugin objects: what differs between DSpark, DFlash, Eagle3 and a third
party's drafter, stated once per kind instead of ``if kind == ...`` branches across the code.

A kind carries:

* its **config rules** — the reference's defaults for :meth:`DrafterConfig.for_target
  <dspark.drafters.config.DrafterConfig.for_target>`, how many target layers it reads, whether it
  has a sequential head, a fixed number of draft layers, the z-lab anchorless layout;
* its **module** (an ``nn.Module`` class built from a :class:`~dspark.drafters.config.DrafterConfig`),
  whose class attributes ``round`` (:func:`~dspark.drafters.loop.block_round` /
  :func:`~dspark.drafters.loop.autoregressive_round`) and ``graph_specs`` give the runtime step and
  the graphs every runner (PyTorch, ONNX Runtime, TensorRT) executes;
* its **training recipe** — the forward that yields the training targets, the loss, and the
  reference's loss weights (:class:`~dspark.training.trainer.TrainConfig`);
* its **checkpoint facts** — the speculators architecture name, whether tensors are renamed to the
  reference layout, and which kinds a checkpoint of this family may hold.

Kinds are registered through the ``register_drafter_kinds`` hook (built-ins in :mod:`dspark.builtins`);
the module and the training functions are named by import path (``"package.module:attr"``), so a
kind is cheap to register and importing this module loads no model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import attrs

from dspark import plugins
from dspark.protocols.drafter_kind import DrafterKind

__all__ = ["DrafterKind", "NeuralKind", "drafter_kind", "kind_names", "BUILTIN_KINDS"]


def _resolve(path: str) -> Any:
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


@attrs.frozen
class NeuralKind:
    """A kind whose parts are named by import path; see the module docstring for each field."""

    name: str
    description: str
    module: str  # "package.module:Class"
    defaults: Mapping[str, Any] = attrs.field(factory=dict)
    uses_mask_token: bool = False  # the block's mask slots embed target token mask_token_id
    num_target_layers: int | None = None  # a fixed count of target layers read (None: min(5, L − 1))
    fixed_num_layers: int | None = None  # a fixed count of draft layers
    has_head: bool = False  # a sequential head and a confidence head are allowed
    anchorless: bool = False  # sample_from_anchor=False is allowed (z-lab DFlash)
    train_forward: str = "dspark.training.forward:block_forward"
    train_loss: str = "dspark.training.trainer:block_loss"
    loss_weights: Mapping[str, float] = attrs.field(factory=dict)  # TrainConfig overrides
    speculators_arch: str | None = None  # speculators' architecture name (None: not servable there)
    reference_keys: bool = True  # tensors renamed to the reference (DeepSpec) layout on export
    family: str = ""  # kinds of one family load each other's checkpoints (eagle3 ← eagle3-fused)

    def validate(self, config: Any) -> None:
        n = len(config.target_layer_ids)
        if self.num_target_layers is not None and n != self.num_target_layers:
            raise ValueError(f"{self.name} fuses exactly {self.num_target_layers} target layers, got {n}")
        if self.fixed_num_layers is not None and config.num_layers != self.fixed_num_layers:
            n_layers = "one draft layer" if self.fixed_num_layers == 1 else f"{self.fixed_num_layers} draft layers"
            raise ValueError(f"{self.name} has exactly {n_layers} (as the reference), got num_layers={config.num_layers}")
        if not config.sample_from_anchor and not (self.anchorless and config.mask_token_id is not None):
            raise ValueError("sample_from_anchor=False is the z-lab DFlash layout: kind dflash with a mask_token_id")
        if not self.has_head and (config.head or config.confidence):
            raise ValueError(f"{self.name} has no sequential head and no confidence head")

    def config_defaults(self, num_target_layers: int, vocab_size: int) -> dict[str, Any]:
        out = dict(self.defaults)
        if self.uses_mask_token:
            out["mask_token_id"] = vocab_size - 1
        return out

    def layer_count(self, num_target_layers: int) -> int:
        """How many target layers the drafter reads by default."""
        return self.num_target_layers or min(5, num_target_layers - 1)

    def build(self, config: Any) -> Any:
        return _resolve(self.module)(config)

    @property
    def module_class(self) -> type:
        return _resolve(self.module)

    def drafting_round(self) -> Any:
        """The drafting round (:mod:`dspark.drafters.loop`) every runner uses for this kind."""
        return self.module_class.round

    def graph_names(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The graphs an export of ``config`` (a DrafterConfig dict) holds, before any module is built."""
        return self.module_class.graph_names(config)

    def training_recipe(self) -> tuple[Any, Any]:
        return _resolve(self.train_forward), _resolve(self.train_loss)

    @property
    def family_name(self) -> str:
        return self.family or self.name


BUILTIN_KINDS: tuple[NeuralKind, ...] = (
    NeuralKind(
        "dspark", "DSpark: parallel backbone + sequential head + confidence head.",
        "dspark.drafters.neural:BlockDrafter",
        defaults={"num_layers": 5, "head": "vanilla-markov", "confidence": True},
        uses_mask_token=True, has_head=True, speculators_arch="DSparkDraftModel"),
    NeuralKind(
        "dflash", "DFlash: the parallel backbone alone.", "dspark.drafters.neural:BlockDrafter",
        defaults={"num_layers": 5}, uses_mask_token=True, anchorless=True,
        loss_weights={"lambda_ce": 1.0, "lambda_l1": 0.0, "lambda_conf": 0.0},
        speculators_arch="DFlashDraftModel"),
    NeuralKind(
        "eagle3", "Eagle3 (DeepSpec layout): one autoregressive layer over the fused target features.",
        "dspark.drafters.eagle3:Eagle3Drafter", defaults={"num_layers": 1}, fixed_num_layers=1,
        train_forward="dspark.training.forward:eagle3_forward", train_loss="dspark.training.trainer:eagle3_loss",
        loss_weights={"lambda_ce": 0.0, "lambda_l1": 0.0, "lambda_conf": 0.0, "lambda_soft_ce": 1.0},
        speculators_arch="Eagle3DraftModel", reference_keys=False, family="eagle3"),
    NeuralKind(
        "eagle3-fused", "legacy: dspark's pre-reference Eagle3 layout (format_version 1 checkpoints).",
        "dspark.drafters.neural:Eagle3FusedDrafter", defaults={"num_layers": 1}, num_target_layers=3,
        train_forward="dspark.training.forward:eagle3_forward", train_loss="dspark.training.trainer:eagle3_loss",
        loss_weights={"lambda_ce": 0.0, "lambda_l1": 0.0, "lambda_conf": 0.0, "lambda_soft_ce": 1.0},
        family="eagle3"),
)


def drafter_kind(name: str) -> NeuralKind:
    """The registered kind ``name`` (built-in or a plugin's); a clear error naming the known ones."""
    reg = plugins.registry()["drafter_kinds"]
    if name not in reg:
        raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(sorted(reg))}")
    return _instances(name, reg[name].factory)


_cache: dict[str, tuple[Any, Any]] = {}


def _instances(name: str, factory: Any) -> Any:
    hit = _cache.get(name)
    if hit is None or hit[0] is not factory:  # re-registered (tests register and unregister plugins)
        obj = factory()
        if not isinstance(obj, DrafterKind):
            raise TypeError(f"drafter kind {name!r} does not satisfy the DrafterKind protocol")
        hit = _cache[name] = (factory, obj)
    return hit[1]


def kind_names() -> list[str]:
    return sorted(plugins.registry()["drafter_kinds"])
