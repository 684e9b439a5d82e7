"""SPS profiles: measured step times of one target on one device, read from and written to JSON.

Every defect of a profile file raises :class:`ProfileError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from attrs import field, frozen

from dspark.cost_models.accounting import check_accounting, is_number

__all__ = ["ProfileError", "SPSProfile", "default_profile_path"]


class ProfileError(ValueError):
    """An SPS profile is missing a field, holds a bad value, or cannot be read."""


def _check_profile_accounting(inst: object, attribute: Any, value: object) -> None:
    try:
        check_accounting(inst, attribute, value)
    except ValueError as err:
        raise ProfileError(str(err)) from None


def _parse_point(index: int, point: Mapping[str, Any]) -> tuple[Any, Any]:
    """One JSON point {"batch_size", "step_seconds" | "steps_per_second"} → (B, seconds)."""
    where = f"points[{index}]"
    unknown = set(point) - {"batch_size", "step_seconds", "steps_per_second"}
    if unknown:
        raise ProfileError(f"{where} has unknown field(s) {sorted(unknown)}")
    if "batch_size" not in point:
        raise ProfileError(f"{where}.batch_size is missing")
    has_seconds, has_rate = "step_seconds" in point, "steps_per_second" in point
    if has_seconds == has_rate:
        raise ProfileError(
            f"{where} must give exactly one of step_seconds / steps_per_second, "
            f"got {'both' if has_seconds else 'neither'}"
        )
    if has_seconds:
        return point["batch_size"], point["step_seconds"]
    rate = point["steps_per_second"]
    if not is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ProfileError(f"{where}.steps_per_second must be a finite number > 0, got {rate!r}")
    return point["batch_size"], 1.0 / rate


def _to_points(value: object) -> tuple[tuple[Any, Any], ...]:
    """{B: seconds}, [(B, seconds)] or JSON point dicts → ((B, seconds), ...), unvalidated.

    A mapping is sorted (its order means nothing); a sequence keeps its order so that an
    unsorted file is reported rather than silently reordered.
    """
    try:
        items = sorted(value.items()) if isinstance(value, Mapping) else list(value)  # type: ignore[attr-defined]
        return tuple(
            _parse_point(i, p) if isinstance(p, Mapping) else tuple(p) for i, p in enumerate(items)
        )
    except ProfileError:
        raise
    except (TypeError, ValueError):
        raise ProfileError(
            "points must be a list of {batch_size, step_seconds} objects, (batch_size, "
            f"step_seconds) pairs or a {{batch_size: step_seconds}} mapping, got {value!r}"
        ) from None


def _check_points(_inst: object, _attr: object, points: tuple[tuple[Any, Any], ...]) -> None:
    if not points:
        raise ProfileError("points must hold at least one measured point")
    previous = 0
    for i, point in enumerate(points):
        if len(point) != 2:
            raise ProfileError(f"points[{i}] must be a (batch_size, step_seconds) pair")
        size, seconds = point
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProfileError(f"points[{i}].batch_size must be an integer >= 1, got {size!r}")
        if size == previous:
            raise ProfileError(f"points[{i}].batch_size {size} is a duplicate")
        if size < previous:
            raise ProfileError(
                f"points[{i}].batch_size {size} follows {previous}: points must be sorted by "
                "batch_size, ascending"
            )
        if not is_number(seconds) or not math.isfinite(seconds) or seconds <= 0:
            raise ProfileError(
                f"points[{i}].step_seconds must be a finite number > 0, got {seconds!r}"
            )
        previous = size


def _nonempty_str(_inst: object, attribute: Any, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _optional_threads(_inst: object, _attr: object, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ProfileError(f"threads must be an integer >= 1 or absent, got {value!r}")


def _notes(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, str):
        raise ProfileError(f"notes must be a string, got {value!r}")


_REQUIRED_FIELDS = ("device", "model", "dtype", "date", "accounting", "points")
_OPTIONAL_FIELDS = ("threads", "notes", "batch_overhead", "context", "contexts", "plain_steps")


def _optional_context(_inst: object, _attr: object, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ProfileError(f"context must be an integer >= 0 (tokens of KV cache per request) or absent, got {value!r}")


def _to_contexts(value: object) -> tuple[tuple[int, tuple[tuple[Any, Any], ...], tuple[tuple[Any, Any], ...]], ...]:
    """[{context, points, batch_overhead?}] (JSON), [(context, points)] or [(context, points,
    batch_overhead)] → ((context, points, batch_overhead), ...), points and overheads parsed
    (an absent overhead is ())."""
    out = []
    for i, entry in enumerate(value or ()):  # type: ignore[union-attr]
        if isinstance(entry, Mapping):
            unknown = set(entry) - {"context", "points", "batch_overhead"}
            if unknown or "context" not in entry or "points" not in entry:
                raise ProfileError(f"contexts[{i}] must be {{context, points, batch_overhead?}}, got fields {sorted(entry)}")
            ctx, pts, overhead = entry["context"], entry["points"], entry.get("batch_overhead", ())
        else:
            try:
                ctx, pts, *rest = entry
            except (TypeError, ValueError):
                raise ProfileError(f"contexts[{i}] must be a (context, points[, batch_overhead]) tuple") from None
            if len(rest) > 1:
                raise ProfileError(f"contexts[{i}] must be a (context, points[, batch_overhead]) tuple")
            overhead = rest[0] if rest else ()
        try:
            parsed = _to_points(pts)
            _check_points(None, None, parsed)
            alpha = _to_overhead(overhead)
            _check_overhead(None, None, alpha)
        except ProfileError as err:
            raise ProfileError(f"contexts[{i}]: {err}") from None
        out.append((ctx, parsed, alpha))
    return tuple(out)


def _check_contexts(inst: Any, _attr: object, value: tuple[tuple[int, Any], ...]) -> None:
    if value and inst.context is None:
        raise ProfileError("contexts needs context: the KV context per request at which points were measured")
    seen = [] if inst.context is None else [inst.context]
    for i, (ctx, _pts, _alpha) in enumerate(value):
        _optional_context(None, None, ctx)
        if ctx in seen:
            raise ProfileError(f"contexts[{i}].context {ctx} is measured twice")
        seen.append(ctx)


def _to_overhead(value: object) -> tuple[tuple[Any, Any], ...]:
    """[{num_requests, seconds}] or [(R, seconds)] → ((R, seconds), ...), unvalidated."""
    try:
        return tuple((p["num_requests"], p["seconds"]) if isinstance(p, Mapping) else tuple(p)
                     for p in value)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError):
        raise ProfileError("batch_overhead must be a list of {num_requests, seconds} objects, got "
                           f"{value!r}") from None


def _check_overhead(_inst: object, _attr: object, points: tuple[tuple[Any, Any], ...]) -> None:
    previous = 0
    for i, point in enumerate(points):
        if len(point) != 2:
            raise ProfileError(f"batch_overhead[{i}] must be a (num_requests, seconds) pair")
        R, seconds = point
        if not isinstance(R, int) or isinstance(R, bool) or R <= previous:
            raise ProfileError(f"batch_overhead[{i}].num_requests must be an integer above {previous}, got {R!r}")
        if not is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise ProfileError(f"batch_overhead[{i}].seconds must be a finite number >= 0, got {seconds!r}")
        previous = R


def _to_plain_steps(value: object) -> tuple[tuple[Any, Any, Any], ...]:
    """[{context, num_requests, step_seconds}] (JSON) or [(context, R, seconds)] → ((context, R,
    seconds), ...), unvalidated."""
    if value is not None and (isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__")):
        raise ProfileError(f"plain_steps must be a list of {{context, num_requests, step_seconds}} objects, got {value!r}")
    out = []
    for i, entry in enumerate(value or ()):  # type: ignore[union-attr]
        if isinstance(entry, Mapping):
            unknown = set(entry) ^ {"context", "num_requests", "step_seconds"}
            if unknown:
                raise ProfileError(f"plain_steps[{i}] must be {{context, num_requests, step_seconds}}, "
                                   f"got fields {sorted(entry)}")
            entry = (entry["context"], entry["num_requests"], entry["step_seconds"])
        try:
            context, R, seconds = entry
        except (TypeError, ValueError):
            raise ProfileError(f"plain_steps[{i}] must be a (context, num_requests, step_seconds) triple") from None
        out.append((context, R, seconds))
    return tuple(out)


def _check_plain_steps(_inst: object, _attr: object, rows: tuple[tuple[Any, Any, Any], ...]) -> None:
    seen: set[tuple[int, int]] = set()
    for i, (context, R, seconds) in enumerate(rows):
        if not isinstance(context, int) or isinstance(context, bool) or context < 0:
            raise ProfileError(f"plain_steps[{i}].context must be an integer >= 0, got {context!r}")
        if not isinstance(R, int) or isinstance(R, bool) or R < 1:
            raise ProfileError(f"plain_steps[{i}].num_requests must be an integer >= 1, got {R!r}")
        if not is_number(seconds) or not math.isfinite(seconds) or seconds <= 0:
            raise ProfileError(f"plain_steps[{i}].step_seconds must be a finite number > 0, got {seconds!r}")
        if (context, R) in seen:
            raise ProfileError(f"plain_steps[{i}] repeats context {context}, num_requests {R}")
        seen.add((context, R))


@frozen
class SPSProfile:
    """Measured verification step times of one target on one device.

    ``points`` pairs each profiled batch size B (tokens, strictly increasing) with its step time in
    seconds; ``accounting`` says which shape B was measured as (packed or padded).
    ``batch_overhead`` (optional) pairs request counts R with α(R), the part of a step that grows
    with the number of requests rather than with B (separate KV caches, per-request bookkeeping):
    a step costs points(B) + α(R), the additive model ``dspark profile`` fits (α(1) = 0).
    """

    device: str = field(validator=_nonempty_str)
    model: str = field(validator=_nonempty_str)
    dtype: str = field(validator=_nonempty_str)
    date: str = field(validator=_nonempty_str)
    accounting: str = field(validator=_check_profile_accounting)
    points: tuple[tuple[int, float], ...] = field(converter=_to_points, validator=_check_points)
    threads: int | None = field(default=None, validator=_optional_threads)
    notes: str = field(default="", validator=_notes)
    batch_overhead: tuple[tuple[int, float], ...] = field(default=(), converter=_to_overhead,
                                                          validator=_check_overhead)
    # The mean KV context per request (tokens) at which ``points`` were measured, and curves at
    # other contexts: a step over long contexts reads more KV cache (attention). Absent in
    # profiles from before: their one curve is used at every context.
    context: int | None = field(default=None, validator=_optional_context)
    # Each entry is (context, points, batch_overhead): a curve's own α(R) when its shapes could be
    # split (`dspark profile` times every context alike); () reads the main ``batch_overhead``.
    contexts: tuple[tuple[int, tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]], ...] = field(
        default=(), converter=_to_contexts, validator=_check_contexts)
    # Plain decoding steps (one token per request) timed back to back, as (context, R, seconds):
    # a step right after the same step can run faster than one after a different shape or after a
    # drafter's forward (its working set still in the caches, presumably), and ``points`` time
    # each shape after a random other one, as a drafted round's verification runs. The draft gate
    # compares drafting with plain decoding at this speed. Absent: t(B = R) + α(R).
    plain_steps: tuple[tuple[int, int, float], ...] = field(default=(), converter=_to_plain_steps,
                                                           validator=_check_plain_steps)

    def curves(self) -> tuple[tuple[int | None, tuple[tuple[int, float], ...]], ...]:
        """Every measured curve as (context, points), sorted by context (one curve: its context may be None)."""
        return tuple((c, pts) for c, pts, _ in self._sorted())

    def overhead_curves(self) -> tuple[tuple[int | None, tuple[tuple[int, float], ...]], ...]:
        """α(R) at each curve's context as (context, batch_overhead), in the order of :meth:`curves`
        (a curve without its own α takes the main ``batch_overhead``)."""
        return tuple((c, alpha or self.batch_overhead) for c, _, alpha in self._sorted())

    def _sorted(self) -> list[tuple[int | None, Any, Any]]:
        return sorted([(self.context, self.points, self.batch_overhead), *self.contexts], key=lambda c: c[0] or 0)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(size for size, _ in self.points)

    @property
    def step_seconds(self) -> tuple[float, ...]:
        return tuple(float(seconds) for _, seconds in self.points)

    @classmethod
    def from_json(
        cls, source: str | os.PathLike[str] | Traversable | Mapping[str, Any]
    ) -> SPSProfile:
        """Read a profile from a JSON file (path) or an already-parsed dict.

        Any defect raises :class:`ProfileError` naming the file and the field.
        """
        if isinstance(source, Mapping):
            where, data = "SPS profile", source
        elif isinstance(source, (str, os.PathLike, Traversable)):
            path = source if isinstance(source, Traversable) else Path(source)
            where = f"SPS profile {path}"
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except OSError as err:
                raise ProfileError(f"{where}: cannot read it ({err.strerror or err})") from None
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ProfileError(f"{where}: not valid JSON ({err})") from None
        else:
            raise TypeError(
                f"an SPS profile is read from a path or a dict, got {type(source).__name__}"
            )
        try:
            if not isinstance(data, Mapping):
                raise ProfileError(f"must be a JSON object, got {type(data).__name__}")
            missing = [name for name in _REQUIRED_FIELDS if name not in data]
            if missing:
                raise ProfileError(f"missing required field(s) {missing}")
            unknown = set(data) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS)
            if unknown:
                raise ProfileError(f"unknown field(s) {sorted(unknown)}")
            return cls(**data)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form read by :meth:`from_json`; optional fields only when set."""
        data: dict[str, Any] = {
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "date": self.date,
            "accounting": self.accounting,
            "points": [{"batch_size": b, "step_seconds": s} for b, s in self.points],
        }
        if self.threads is not None:
            data["threads"] = self.threads
        if self.notes:
            data["notes"] = self.notes
        if self.batch_overhead:
            data["batch_overhead"] = [{"num_requests": r, "seconds": v} for r, v in self.batch_overhead]
        if self.context is not None:
            data["context"] = self.context
        if self.contexts:
            data["contexts"] = [
                {"context": c, "points": [{"batch_size": b, "step_seconds": t} for b, t in pts],
                 **({"batch_overhead": [{"num_requests": r, "seconds": v} for r, v in alpha]} if alpha else {})}
                for c, pts, alpha in self.contexts]
        if self.plain_steps:
            data["plain_steps"] = [{"context": c, "num_requests": r, "step_seconds": t} for c, r, t in self.plain_steps]
        return data

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def default_profile_path() -> Traversable:
    """The shipped CPU profile of SmolLM2-135M in fp32, a starting point: re-profile your machine with `dspark profile`."""
    return resources.files("dspark") / "data" / "cpu_smollm2_fp32.json"
