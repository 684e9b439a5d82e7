"""Configuration of the neural drafters, and the target a drafter belongs to."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import field, frozen, validators

from dspark.drafters.kinds import drafter_kind, kind_of_format_v1
from dspark.drafters.layers import LayerShape

__all__ = ["TargetInfo", "DrafterConfig", "default_layer_ids"]

# The largest block size γ: a request keeps q [γ, V] per round (V = 49k: 64 × 49k floats ≈ 12 MB);
# γ = 1000 would be ~200 MB a request and no acceptance profile reaches that far.
MAX_GAMMA = 64
# "silu-markov" and "eagle3-fused" are dspark's pre-reference variants (docs/interop.md): kept so
# the checkpoints written in format_version 1 still load; new drafters use the reference forms.
HEADS = ("vanilla-markov", "gated-markov", "rnn", "silu-markov")
FORMAT_VERSION = 2


def _known_head(_i: Any, _a: Any, value: str | None) -> None:
    """A built-in head, or one a plugin registered through ``register_sequential_heads``."""
    if value is None or value in HEADS:
        return
    from dspark.plugins import registry

    registered = registry()["sequential_heads"]
    if value not in registered:
        raise ValueError(
            f"unknown sequential head {value!r}; registered: {', '.join(sorted(registered))} "
            "(a plugin head must be installed or registered before the drafter is built)"
        )


def default_layer_ids(num_layers: int, m: int = 5) -> list[int]:
    """m evenly spread decoder-layer ids (0-based), excluding the last layer (docs/concepts.md §1).

    The reference (DFlash/DeepSpec ``build_target_layer_ids``) spreads m ids over [1, L − 3]::

        ids_i = round(1 + i · (L − 4) / (m − 1)),  i = 0..m−1      (m = 1: [L // 2])

    with Python's ``round`` (half to even), so Qwen3-4B (L = 36) gives [1, 9, 17, 25, 33].
    When [1, L − 3] is too short for m distinct ids (L − 4 < m − 1) the ids are spread the same
    way over [0, L − 2] instead; asking for more than L − 1 ids (all but the last layer) raises.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    if m == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end - start < m - 1:
        start, end = 0, num_layers - 2
        if end - start < m - 1:
            raise ValueError(
                f"cannot pick {m} distinct layer ids excluding the last from {num_layers} layers "
                f"(at most {max(num_layers - 1, 0)})"
            )
    span = end - start
    return [int(round(start + i * span / (m - 1))) for i in range(m)]


@frozen
class TargetInfo:
    """What a checkpoint records about the target it was trained for."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int

    def check_compatible(self, other: TargetInfo, layer_ids: tuple[int, ...]) -> None:
        """Raise a ValueError naming every mismatch between this and the target given."""
        problems = []
        if self.vocab_size != other.vocab_size:
            problems.append(f"vocab size {self.vocab_size} ≠ target's {other.vocab_size}")
        if self.hidden_size != other.hidden_size:
            problems.append(f"hidden size {self.hidden_size} ≠ target's {other.hidden_size}")
        bad = [i for i in layer_ids if not 0 <= i < other.num_layers]
        if bad:
            problems.append(f"layer ids {bad} outside the target's 0..{other.num_layers - 1}")
        if problems:
            raise ValueError(
                f"drafter trained for {self.name!r} does not fit target {other.name!r}: "
                + "; ".join(problems)
            )


def _positive(_i: Any, a: Any, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{a.name} must be a positive integer, got {v!r}")


@frozen
class DrafterConfig:
    """A neural drafter's architecture. Draft layers copy the target's layer shape."""

    kind: str = field(validator=validators.instance_of(str))
    vocab_size: int = field(validator=_positive)
    layer: LayerShape = field(converter=lambda v: v if isinstance(v, LayerShape) else LayerShape(**v))
    target: TargetInfo = field(converter=lambda v: v if isinstance(v, TargetInfo) else TargetInfo(**v))
    target_layer_ids: tuple[int, ...] = field(converter=tuple)
    num_layers: int = field(default=5, validator=_positive)
    gamma: int = field(default=7, validator=[_positive, validators.le(MAX_GAMMA)])
    head: str | None = field(default=None, validator=_known_head)
    rank: int = field(default=256, validator=_positive)
    confidence: bool = field(default=False)
    # The block's mask slots are embedded with this target token's (frozen) input embedding, as the
    # reference does (DeepSpec / speculators / vLLM). None: a learned mask vector (dspark's
    # pre-reference variant, format_version 1 checkpoints).
    mask_token_id: int | None = field(default=None)
    # True (DeepSpec, speculators DSpark): the block is [anchor, MASK × (γ−1)] and row j predicts
    # the token at a+j+1. False (z-lab DFlash, speculators' DFlash default): the block is
    # [anchor, MASK × γ] and the anchor row predicts nothing; rows 1..γ give the γ drafts.
    sample_from_anchor: bool = field(default=True, validator=validators.instance_of(bool))
    # Reduced draft vocabulary (EAGLE-3's d2t): the drafter scores only this many target tokens
    # (the last slot is a never-drawn placeholder for anchors outside it). None: the full vocab.
    draft_vocab_size: int | None = field(default=None, validator=validators.optional(_positive))

    def __attrs_post_init__(self) -> None:
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} name a layer twice")
        self.target.check_compatible(self.target, self.target_layer_ids)
        kind = drafter_kind(self.kind)  # a registered kind (built-in or a plugin's) or a clear error
        if self.mask_token_id is not None and not (
            isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(f"mask_token_id must be a token id in [0, {self.vocab_size}), got {self.mask_token_id!r}")
        kind.validate(self)
        if self.draft_vocab_size is not None and not 2 <= self.draft_vocab_size <= self.vocab_size + 1:
            raise ValueError(
                f"draft_vocab_size must be in [2, vocab_size + 1 = {self.vocab_size + 1}], got {self.draft_vocab_size}"
            )
        if self.layer.num_heads % self.layer.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        kind: str = "dspark",
        *,
        target_name: str = "target",
        layer_ids: tuple[int, ...] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Copy the layer shape from an HF config; defaults per kind are the reference's (docs/drafters-and-training.md).

        Draft layers are Qwen3 layers (per-head q/k RMSNorm) whatever the target's architecture, as
        in DeepSpec and vLLM's DSpark model; the mask slots use the target's embedding of
        ``mask_token_id`` (default: the last vocabulary id).
        """
        c = target_config
        heads = c.num_attention_heads
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
        shape = LayerShape(
            hidden_size=c.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-5),
            rope_theta=float(rope),
            qk_norm=True,
        )
        L = c.num_hidden_layers
        spec = drafter_kind(kind)
        if layer_ids is None:
            layer_ids = default_layer_ids(L, spec.layer_count(L))
        defaults = spec.config_defaults(L, c.vocab_size)
        return cls(
            kind=kind,
            vocab_size=c.vocab_size,
            layer=shape,
            target=TargetInfo(target_name, c.vocab_size, c.hidden_size, L),
            target_layer_ids=tuple(layer_ids),
            **{**defaults, **overrides},
        )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v)

    @classmethod
    def from_dict(cls, data: dict[str, Any], format_version: int = FORMAT_VERSION) -> DrafterConfig:
        """From :meth:`to_dict`; ``format_version`` 1 configs name dspark's pre-reference variants
        by the names the reference forms now carry, so they are renamed (docs/interop.md)."""
        if format_version == 1:
            data = dict(data)
            if isinstance(data.get("kind"), str):
                data["kind"] = kind_of_format_v1(data["kind"])
            if data.get("head") == "vanilla-markov":
                data["head"] = "silu-markov"
        known = {a.name for a in attrs.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"drafter config has unknown fields {sorted(unknown)}")
        missing = [a.name for a in attrs.fields(cls) if a.default is attrs.NOTHING and a.name not in data]
        if missing:
            raise ValueError(f"drafter config is missing fields {missing}")
        return cls(**data)
