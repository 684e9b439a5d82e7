"""What a TensorRT build covers: an :class:`EngineProfile` — the (min, opt, max) range of every
dynamic axis, the precision and the typing — read from a JSON file or a shipped preset
(:func:`load_profile`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from dspark.export.manifest import ExportError

__all__ = ["PRECISIONS", "PROFILES", "EngineProfile", "load_profile", "shipped_profiles"]

Range = tuple[int, int, int]


def _range(name: str) -> Callable[[Any, Any, Any], None]:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if (not isinstance(value, tuple) or len(value) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"{name} must be three integers min,opt,max, got {value!r}")
        lo, opt, hi = value
        if not 1 <= lo <= opt <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= opt <= max, got {lo},{opt},{hi}")
    return check


def _as_range(v: Any) -> Any:
    if isinstance(v, str):
        try:
            v = [int(x) for x in v.split(",")]
        except ValueError:
            return v
    return tuple(v) if isinstance(v, (list, tuple)) else v


PRECISIONS = ("fp32", "fp16", "bf16")


@attrs.frozen
class EngineProfile:
    """Optimisation-profile ranges (min, opt, max) for the dynamic axes, the precision and typing.

    ``batch``: requests per round; ``past``: padded context length (tokens before the anchor);
    ``new``: context positions ingested in one call (prompt prefill, packed over requests; longer
    ingestions are split into chunks of at most ``new`` max).
    """

    batch: Range = attrs.field(default=(1, 8, 64), converter=_as_range, validator=_range("batch"))
    past: Range = attrs.field(default=(1, 1024, 4096), converter=_as_range, validator=_range("past"))
    new: Range = attrs.field(default=(1, 64, 4096), converter=_as_range, validator=_range("new"))
    precision: str = attrs.field(default="fp32", validator=attrs.validators.in_(PRECISIONS))
    workspace_gib: float = attrs.field(default=4.0)
    # None: strongly typed where the precision's BuilderFlag is gone (TensorRT 11); True forces it
    # (TensorRT 10 has NetworkDefinitionCreationFlag.STRONGLY_TYPED too); False: builder flags.
    strongly_typed: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))

    def axes(self, graph: str, gamma: int, block: int | None = None) -> dict[str, Range]:
        """Axis name → (min, opt, max) for one graph (graph names are unique across drafter kinds;
        ``block``: the backbone's rows, γ, or γ + 1 in the anchorless z-lab layout)."""
        g = (block or gamma,) * 3
        step_past = (self.past[0], self.past[1] + gamma, self.past[2] + gamma)  # + the γ step slots
        table = {"context": {"new": self.new}, "fuse": {"new": self.new},
                 "backbone": {"batch": self.batch, "block": g, "past": self.past},
                 "head": {"batch": self.batch},
                 "step": {"batch": self.batch, "new": (1, 1, 1), "past": step_past}}
        if graph not in table:
            raise ValueError(f"no TensorRT optimisation profile for a graph named {graph!r}")
        return table[graph]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}


#: the presets shipped with the package (``--profile NAME`` picks one by its file name)
PROFILES = Path(__file__).parents[1] / "profiles"


def shipped_profiles() -> list[str]:
    """The names of the shipped presets (``default``, ``interactive-fp16``, ``serving-bf16``)."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load_profile(path: str | Path | None = None, **overrides: Any) -> EngineProfile:
    """An :class:`EngineProfile` from a JSON file, or a shipped preset by name
    (:func:`shipped_profiles`), then ``overrides`` (None values ignored). Unknown keys are an
    error; ``description`` is allowed."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file() and str(path) in shipped_profiles():
            p = PROFILES / f"{path}.json"
        if not p.is_file():
            raise ExportError(f"profile file {p} does not exist (shipped presets: {', '.join(shipped_profiles())})")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"profile file {p} is not valid JSON ({exc})") from None
        data.pop("description", None)
        unknown = set(data) - {f.name for f in attrs.fields(EngineProfile)}
        if unknown:
            raise ExportError(f"profile file {p} has unknown keys {sorted(unknown)}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EngineProfile(**data)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"bad engine profile: {exc}") from None
