"""The plugin manager: built-ins and third-party plugins through the same hooks.

One :class:`pluggy.PluginManager` for the process. It registers :mod:`dspark.builtins`, loads the
``dspark`` entry-point group (unless ``DSPARK_DISABLE_PLUGINS`` says otherwise: ``1``/``all``
disables every entry-point plugin, a comma-separated list disables those names) and fails loudly:
a misspelled hook, a name registered twice, a factory that does not satisfy its protocol, or a
plugin that raises while loading or registering is a :class:`PluginError` naming the plugin and
the name.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pluggy
from attrs import frozen

from dspark import hookspecs
from dspark.protocols import (
    Calibrator,
    ConfidenceModel,
    CostModel,
    Drafter,
    DrafterKind,
    Scheduler,
    SequentialHead,
)

__all__ = [
    "PluginError",
    "Registration",
    "EXTENSION_POINTS",
    "get_plugin_manager",
    "register",
    "unregister",
    "registry",
    "create",
    "lookup",
    "list_plugins",
    "reset",
]

ENTRY_POINT_GROUP = "dspark"
BUILTIN_PLUGIN = "dspark"
BUILTIN_MODULE = "dspark.builtins"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered; the message names the plugin and the name."""


@frozen
class ExtensionPoint:
    kind: str  # registry key, e.g. "schedulers"
    noun: str  # for messages, e.g. "scheduler"
    hook: str  # hook name, e.g. "register_schedulers"
    protocol: type


EXTENSION_POINTS: dict[str, ExtensionPoint] = {
    ep.kind: ep
    for ep in (
        ExtensionPoint("drafters", "drafter", "register_drafters", Drafter),
        ExtensionPoint("drafter_kinds", "drafter kind", "register_drafter_kinds", DrafterKind),
        ExtensionPoint("sequential_heads", "sequential head", "register_sequential_heads", SequentialHead),
        ExtensionPoint("confidence_models", "confidence model", "register_confidence_models", ConfidenceModel),
        ExtensionPoint("calibrators", "calibrator", "register_calibrators", Calibrator),
        ExtensionPoint("cost_models", "cost model", "register_cost_models", CostModel),
        ExtensionPoint("schedulers", "scheduler", "register_schedulers", Scheduler),
    )
}


@frozen
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    version: str | None
    description: str


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_registry: dict[str, dict[str, Registration]] | None = None
_versions: dict[str, str | None] = {}
_distributions: dict[str, str | None] = {}  # plugin → the installed distribution that provides it
_disabled: list[str] = []  # entry-point plugins DSPARK_DISABLE_PLUGINS kept out (for error messages)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _disabled_plugins() -> tuple[bool, set[str]]:
    value = os.environ.get("DSPARK_DISABLE_PLUGINS", "").strip()
    if value.lower() in ("1", "true", "yes", "all", "*"):
        return True, set()
    return False, {v.strip() for v in value.split(",") if v.strip()}


def _check_hooks(pm: pluggy.PluginManager, plugin: object, plugin_name: str) -> None:
    """Reject hook implementations with no spec (typically a misspelled hook name)."""
    known = [ep.hook for ep in EXTENSION_POINTS.values()]
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.has_spec():
            continue
        hint = difflib.get_close_matches(caller.name, known, n=1)
        suggestion = f" — did you mean {hint[0]!r}?" if hint else ""
        raise PluginError(
            f"plugin {plugin_name!r} implements unknown hook {caller.name!r}{suggestion} "
            f"(known hooks: {', '.join(known)})"
        )


def _add(pm: pluggy.PluginManager, plugin: object, name: str, version: str | None,
         distribution: str | None = None) -> None:
    if pm.has_plugin(name):
        raise PluginError(f"a plugin named {name!r} is already registered")
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} has an invalid hook implementation: {exc}") from None
    try:
        _check_hooks(pm, plugin, name)
    except PluginError:
        pm.unregister(plugin)
        raise
    _versions[name] = version
    _distributions[name] = distribution


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    disable_all, disabled = _disabled_plugins()
    points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    installed = sorted({ep.name for ep in points})
    unknown = sorted(disabled - set(installed))
    if unknown:  # a misspelled name would otherwise leave the plugin it meant enabled
        hints = [h for u in unknown for h in difflib.get_close_matches(u, installed, n=1)]
        raise PluginError(
            f"DSPARK_DISABLE_PLUGINS names {', '.join(map(repr, unknown))}, which is no installed plugin "
            f"(installed: {', '.join(installed) or 'none'})" + (f" — did you mean {hints[0]!r}?" if hints else ""))
    _disabled[:] = installed if disable_all else sorted(disabled)
    if disable_all:
        return
    for ep in points:
        if ep.name in disabled:
            continue
        dist = getattr(ep, "dist", None)
        where = f"{ep.value}" + (f" from distribution {dist.name} {dist.version}" if dist else "")
        try:
            plugin = ep.load()
        except Exception as exc:  # a plugin may raise anything on import
            raise PluginError(
                f"plugin {ep.name!r} ({where}) failed to load: {type(exc).__name__}: {exc}. "
                f"Set DSPARK_DISABLE_PLUGINS={ep.name} to skip it."
            ) from exc
        _add(pm, plugin, ep.name, dist.version if dist else None, dist.name if dist else None)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created (and entry points loaded) on first use."""
    global _pm
    with _lock:
        if _pm is None:
            from dspark import __version__

            pm = pluggy.PluginManager("dspark")
            pm.add_hookspecs(hookspecs)
            # Built-ins are a plugin module named like any other (as llm's DEFAULT_PLUGINS): the
            # registry imports no implementation, so the implementations may use the registry.
            _add(pm, importlib.import_module(BUILTIN_MODULE), BUILTIN_PLUGIN, __version__, "dspark")
            _load_entry_points(pm)
            pm.check_pending()
            _pm = pm
        return _pm


def register(plugin: object, name: str | None = None, version: str | None = None) -> str:
    """Register a plugin object or module at run time (tests, notebooks); returns its name."""
    with _lock:
        pm = get_plugin_manager()
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        _add(pm, plugin, name, version or getattr(plugin, "__version__", None))
        try:
            _build_registry(pm)
        except PluginError:
            pm.unregister(plugin)
            _versions.pop(name, None)
            _distributions.pop(name, None)
            raise
        _invalidate()
        return name


def unregister(plugin: object | str) -> None:
    """Remove a plugin registered with :func:`register` (by object or name)."""
    with _lock:
        pm = get_plugin_manager()
        if isinstance(plugin, str):
            obj = pm.get_plugin(plugin)
            if obj is None:
                raise PluginError(f"no plugin named {plugin!r} is registered")
            plugin = obj
        name = pm.get_name(plugin)
        pm.unregister(plugin)
        _versions.pop(name, None)
        _distributions.pop(name, None)
        _invalidate()


def reset() -> None:
    """Forget the plugin manager; the next use reloads built-ins and entry points."""
    global _pm
    with _lock:
        _pm = None
        _versions.clear()
        _distributions.clear()
        _disabled.clear()
        _invalidate()


def _invalidate() -> None:
    global _registry
    _registry = None


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def _protocol_methods(protocol: type) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


def _check_factory(point: ExtensionPoint, name: str, factory: Any, plugin: str) -> None:
    if not _NAME_RE.match(name or ""):
        raise PluginError(
            f"plugin {plugin!r} registered {point.noun} name {name!r}: names must be lowercase "
            "letters, digits, '.', '_' or '-'"
        )
    if not callable(factory):
        raise PluginError(f"plugin {plugin!r} registered {point.noun} {name!r} with a non-callable factory")
    if inspect.isclass(factory):
        missing = [m for m in _protocol_methods(point.protocol) if not callable(getattr(factory, m, None))]
        if missing:
            raise PluginError(
                f"plugin {plugin!r} registered {point.noun} {name!r} as {factory.__qualname__}, "
                f"which does not satisfy the {point.protocol.__name__} protocol "
                f"(missing: {', '.join(missing)})"
            )


def _build_registry(pm: pluggy.PluginManager) -> dict[str, dict[str, Registration]]:
    reg: dict[str, dict[str, Registration]] = {kind: {} for kind in EXTENSION_POINTS}
    for point in EXTENSION_POINTS.values():
        caller = getattr(pm.hook, point.hook)
        # Call each implementation on its own so every registration is attributed to its plugin.
        for impl in caller.get_hookimpls():  # registration order: built-ins first
            plugin = impl.plugin_name

            def _register(name: str, factory: Callable[..., Any], description: str = "",
                          _point=point, _plugin=plugin) -> None:
                _check_factory(_point, name, factory, _plugin)
                existing = reg[_point.kind].get(name)
                if existing is not None:
                    raise PluginError(
                        f"{_point.noun} {name!r} is registered twice: by plugin "
                        f"{existing.plugin!r} and by plugin {_plugin!r}"
                    )
                doc = description or (inspect.getdoc(factory) or "").split("\n")[0]
                reg[_point.kind][name] = Registration(
                    _point.kind, name, factory, _plugin, _versions.get(_plugin), doc
                )

            try:
                impl.function(register=_register)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {plugin!r} failed in {point.hook}: {type(exc).__name__}: {exc}"
                ) from exc
    return reg


def registry() -> dict[str, dict[str, Registration]]:
    """kind → name → Registration, for every extension point."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = _build_registry(get_plugin_manager())
        return _registry


def lookup(kind: str, name: str, /) -> Registration:
    """The registration of ``name`` at extension point ``kind``; a clear error when there is none
    (callers check names this way before a slow model load)."""
    point = EXTENSION_POINTS.get(kind)
    if point is None:
        raise KeyError(f"unknown extension point {kind!r}; known: {', '.join(EXTENSION_POINTS)}")
    entries = registry()[kind]
    entry = entries.get(name)
    if entry is None:
        hint = difflib.get_close_matches(name, list(entries), n=1)
        off = (f"; plugins disabled by DSPARK_DISABLE_PLUGINS: {', '.join(_disabled)} — it may come from one "
               "of them" if _disabled else "")
        raise ValueError(
            f"unknown {point.noun} {name!r}"
            + (f" — did you mean {hint[0]!r}?" if hint else "")
            + f" (available: {', '.join(sorted(entries)) or 'none'}{off})"
        )
    return entry


def create(kind: str, name: str, /, **config: Any) -> Any:
    """Build the ``name`` implementation of extension point ``kind`` with ``config``."""
    entry = lookup(kind, name)
    point = EXTENSION_POINTS[kind]
    try:
        obj = entry.factory(**config)
    except (TypeError, ValueError) as exc:
        # attrs validators raise ValueError(message, attribute, options, value): keep the message
        detail = exc.args[0] if len(exc.args) > 1 and isinstance(exc.args[0], str) else exc
        message = f"{point.noun} {name!r} (plugin {entry.plugin!r}): {detail}"
        # a specific error (ProfileError, CheckpointError, ...) keeps its type for API callers
        error_type = type(exc) if isinstance(exc, ValueError) and type(exc) is not ValueError else ValueError
        try:
            error = error_type(message)
        except Exception:  # an error class that does not take one message
            error = ValueError(message)
        raise error from exc
    if not isinstance(obj, point.protocol):
        raise PluginError(
            f"{point.noun} {name!r} from plugin {entry.plugin!r} built a {type(obj).__qualname__}, "
            f"which does not satisfy the {point.protocol.__name__} protocol"
        )
    return obj


def resolve(kind: str, spec: Any, /, **config: Any) -> Any:
    """A name (built with ``config``) or an already-built object checked against the protocol."""
    if isinstance(spec, str):
        return create(kind, spec, **config)
    point = EXTENSION_POINTS[kind]
    if config:
        raise ValueError(f"config {sorted(config)} given with an already-built {point.noun}")
    if not isinstance(spec, point.protocol):
        raise TypeError(
            f"{type(spec).__qualname__} does not satisfy the {point.protocol.__name__} protocol"
        )
    return spec


def list_plugins() -> list[dict[str, Any]]:
    """One row per registered implementation: kind, name, plugin, the distribution that installed
    it (None for one registered at run time) and its version, description."""
    return [
        {"kind": r.kind, "name": r.name, "plugin": r.plugin, "distribution": _distributions.get(r.plugin),
         "version": r.version, "description": r.description}
        for kind in EXTENSION_POINTS
        for r in sorted(registry()[kind].values(), key=lambda r: r.name)
    ]
