"""Drafter kinds as plugin objects: what differs between DSpark, DFlash, Eagle3 and a third
party's drafter, stated once per kind instead of branches on a kind's name across the code.

Each built-in kind lives in one folder — :mod:`dspark.drafters.dspark`, :mod:`dspark.drafters.dflash`,
:mod:`dspark.drafters.eagle3` (with its legacy ``eagle3-fused`` layout) — holding its kind object,
its ``nn.Module``, its graphs, its drafting round, its training forward and loss, and its
checkpoint rules. The shared code (the drafting loop, the layers, the checkpoint formats, the
trainer) asks the kind object and never names a kind. A kind carries:

* its **config rules** — the reference's defaults for :meth:`DrafterConfig.for_target
  <dspark.drafters.config.DrafterConfig.for_target>`, how many target layers it reads, whether it
  has a sequential head, a fixed number of draft layers, the z-lab anchorless layout;
* its **module** (an ``nn.Module`` class built from a :class:`~dspark.drafters.config.DrafterConfig`),
  whose class attributes ``round`` (the drafting round, :data:`dspark.drafters.loop.RoundFn`) and
  ``graph_specs`` give the runtime step and the graphs every runner (PyTorch, ONNX Runtime,
  TensorRT) executes;
* its **training recipe** — the forward that yields the training targets, the loss, and the
  reference's loss weights (:class:`~dspark.training.trainer.TrainConfig`);
* its **checkpoint rules** — the map from its module's tensor names to the reference (DeepSpec /
  speculators) names, the config fields it writes to and reads from each reference format, what
  those formats cannot hold of it, and which kinds a checkpoint of its family may hold.

Kinds are registered through the ``register_drafter_kinds`` hook (built-ins in :mod:`dspark.builtins`);
the module and the training functions are named by import path (``"package.module:attr"``), so a
kind is cheap to register and importing this module loads no model code.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

import attrs

from dspark import plugins
from dspark.protocols.drafter_kind import DrafterKind

__all__ = ["DrafterKind", "NeuralKind", "KeyMap", "drafter_kind", "kind_names", "kind_of_format_v1"]


def _resolve(path: str) -> Any:
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _compile(pairs: tuple[tuple[str, str], ...], src: int) -> list[tuple[re.Pattern[str], str]]:
    """Regexes from side ``src`` of each pair (0: the module, 1: the reference) to the other;
    ``{i}`` in a prefix stands for a layer index."""
    out = []
    for pair in pairs:
        pattern = "^" + re.escape(pair[src]).replace(re.escape("{i}"), r"(\d+)")
        out.append((re.compile(pattern), pair[1 - src].replace("{i}", r"\1")))
    return out


@attrs.frozen
class KeyMap:
    """Tensor-name prefixes of a kind's module ⇄ the reference checkpoint's, as
    ``(module prefix, reference prefix)`` pairs; the first pair whose prefix matches renames a key
    and a key no pair matches keeps its name (so the empty map is the identity)."""

    prefixes: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)
    _to_ref: list[tuple[re.Pattern[str], str]] = attrs.field(init=False, eq=False, repr=False)
    _from_ref: list[tuple[re.Pattern[str], str]] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_to_ref", _compile(self.prefixes, 0))
        object.__setattr__(self, "_from_ref", _compile(self.prefixes, 1))

    def __add__(self, other: KeyMap) -> KeyMap:
        return KeyMap(self.prefixes + other.prefixes)

    @staticmethod
    def _rename(state: Mapping[str, Any], rules: list[tuple[re.Pattern[str], str]]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            k = key
            for pattern, repl in rules:
                k, hit = pattern.subn(repl, key)
                if hit:
                    break
            out[k] = value
        return out

    def to_reference(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self._rename(state, self._to_ref)

    def from_reference(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self._rename(state, self._from_ref)


@attrs.frozen
class NeuralKind:
    """A kind whose parts are named by import path; see the module docstring for each field.

    The checkpoint-format methods here are those of a kind no reference format holds
    (``speculators_arch`` and ``deepspec_arch`` None); a kind that has reference formats
    subclasses this and states its fields (the built-in kind folders)."""

    name: str
    description: str
    module: str  # "package.module:Class"
    defaults: Mapping[str, Any] = attrs.field(factory=dict)
    uses_mask_token: bool = False  # the block's mask slots embed target token mask_token_id
    num_target_layers: int | None = None  # a fixed count of target layers read (None: min(5, L − 1))
    fixed_num_layers: int | None = None  # a fixed count of draft layers
    has_head: bool = False  # a sequential head and a confidence head are allowed
    anchorless: bool = False  # sample_from_anchor=False is allowed (z-lab DFlash)
    train_forward: str = ""  # "package.module:function": forward(drafter, batch) → Targets
    train_loss: str = ""  # "package.module:Class" with terms(cfg, targets) and lambdas(cfg)
    loss_weights: Mapping[str, float] = attrs.field(factory=dict)  # TrainConfig overrides
    speculators_arch: str | None = None  # speculators' architecture name (None: not servable there)
    # the speculators config field holding the target layer ids (speculators' hidden_states indices)
    speculators_layer_ids_field: str = "aux_hidden_state_layer_ids"
    deepspec_arch: str | None = None  # the DeepSpec architecture suffix this kind reads (``*DSparkModel``)
    key_map: KeyMap = KeyMap()  # module tensor names ⇄ the reference's (identity: none renamed)
    family: str = ""  # kinds of one family load each other's checkpoints (eagle3 ← eagle3-fused)
    format_v1_name: str | None = None  # the kind name format_version 1 checkpoints gave this kind

    # -- config rules -------------------------------------------------------------------------
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

    # -- module, graphs, round ----------------------------------------------------------------
    def build(self, config: Any) -> Any:
        return _resolve(self.module)(config)

    @property
    def module_class(self) -> type:
        return _resolve(self.module)

    def drafting_round(self) -> Any:
        """The drafting round (:data:`dspark.drafters.loop.RoundFn`) every runner uses for this kind."""
        return self.module_class.round

    def graph_names(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The graphs an export of ``config`` (a DrafterConfig dict) holds, before any module is built."""
        return self.module_class.graph_names(config)

    # -- training -----------------------------------------------------------------------------
    def training_recipe(self) -> tuple[Any, Any]:
        if not (self.train_forward and self.train_loss):
            raise ValueError(f"drafter kind {self.name!r} names no training forward and loss")
        return _resolve(self.train_forward), _resolve(self.train_loss)

    @property
    def family_name(self) -> str:
        return self.family or self.name

    # -- checkpoint formats (dspark.drafters.formats) -------------------------------------------
    def to_reference_keys(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Module tensor names → the reference's (DeepSpec = speculators)."""
        return self.key_map.to_reference(state)

    def from_reference_keys(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Reference tensor names (``model.`` prefixes already dropped) → the module's."""
        return self.key_map.from_reference(state)

    def refusals(self, config: Any, fmt: str) -> list[str]:
        """Why reference format ``fmt`` ("deepspec" / "speculators") cannot hold a drafter of
        ``config``, as far as its kind decides (one clause each; [] when it can)."""
        if self.speculators_arch is None:
            return [f"it is a {self.name} drafter, a kind no reference format holds (its DrafterKind has no "
                    "speculators architecture)"]
        return []

    def speculators_fields(self, config: Any) -> dict[str, Any]:
        """This kind's fields of a speculators ``config.json``; the shared fields (architecture,
        verifier, layer config, the layer ids under ``speculators_layer_ids_field``) are the
        writer's."""
        raise NotImplementedError(f"drafter kind {self.name!r} has no speculators format")

    def deepspec_fields(self, portable: Any) -> dict[str, Any]:
        """This kind's fields of a DeepSpec ``config.json`` (its architecture included)."""
        raise NotImplementedError(f"drafter kind {self.name!r} has no DeepSpec format")

    def from_speculators(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                         where: Any) -> Any:
        """The DrafterConfig of a speculators config of this kind (``cfg``: the top level with
        ``transformer_layer_config`` merged under it; ``layer_ids`` 0-based decoder layers)."""
        raise NotImplementedError(f"drafter kind {self.name!r} has no speculators format")

    def from_deepspec(self, cfg: dict[str, Any], shape: Any, layer_ids: list[int], target: Any,
                      where: Any) -> Any:
        """The DrafterConfig of a DeepSpec config whose architecture is this kind's."""
        raise NotImplementedError(f"drafter kind {self.name!r} has no DeepSpec format")


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


def kind_of_format_v1(name: str) -> str:
    """The kind a format_version 1 checkpoint's ``kind`` field means today: the kind whose
    ``format_v1_name`` it is (dspark's pre-reference variants were renamed when the reference
    forms took their names), else ``name`` itself."""
    for kind in kind_names():
        if getattr(drafter_kind(kind), "format_v1_name", None) == name:
            return kind
    return name
