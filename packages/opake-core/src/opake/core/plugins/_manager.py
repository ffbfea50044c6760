"""Plugin discovery (entry points in group ``opake``) and the typed queries over hooks."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from opake.core.errors import ConfigurationError, InputTypeError, OpakePluginWarning
from opake.core.plugins import hookspecs
from opake.core.plugins._descriptors import KernelBackend, ModelFamily

__all__ = [
    "ENTRY_POINT_GROUP",
    "BrokenPlugin",
    "PluginInfo",
    "broken_plugins",
    "kernel_backends",
    "model_families",
    "plugin_manager",
    "plugins",
    "register_plugin",
    "reset_plugins",
]

#: the entry-point group every plugin (first- and third-party) registers under
ENTRY_POINT_GROUP = "opake"
_DISABLE_ENV = "OPAKE_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: its name, where it came from, and the module/object."""

    name: str
    distribution: str | None
    version: str | None
    value: str


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that failed to load (skipped, with a warning)."""

    name: str
    distribution: str | None
    version: str | None
    value: str
    error: str


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pm: pluggy.PluginManager | None = None
        self.infos: list[PluginInfo] = []
        self.broken: list[BrokenPlugin] = []
        self.families: dict[str, ModelFamily] | None = None
        self.backends: dict[str, KernelBackend] | None = None


_state = _State()


def _autoload_disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    seen: dict[str, PluginInfo] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist_name, dist_version = _dist_of(ep)
        if ep.name in seen:
            if seen[ep.name].value == ep.value:  # same distribution seen twice on sys.path
                continue
            raise ConfigurationError(
                f"two plugins claim the entry-point name {ep.name!r}: {seen[ep.name].value!r} "
                f"(from {seen[ep.name].distribution}) and {ep.value!r} (from {dist_name}). "
                "Uninstall one of them or rename its entry point."
            )
        try:
            obj = ep.load()
        except Exception as err:
            msg = f"{type(err).__name__}: {err}"
            _state.broken.append(BrokenPlugin(ep.name, dist_name, dist_version, ep.value, msg))
            warnings.warn(
                f"opake plugin {ep.name!r} ({ep.value}, from {dist_name} {dist_version}) "
                f"failed to load and was skipped: {msg}. Run `opake info` for details.",
                OpakePluginWarning,
                stacklevel=3,
            )
            continue
        info = PluginInfo(ep.name, dist_name, dist_version, ep.value)
        seen[ep.name] = info
        pm.register(obj, name=ep.name)
        _state.infos.append(info)


def plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first use.

    Set ``OPAKE_DISABLE_PLUGIN_AUTOLOAD=1`` to skip entry points (only plugins registered
    with :func:`register_plugin` are then used).

    >>> plugin_manager().project_name
    'opake'
    """
    with _state.lock:
        if _state.pm is None:
            pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
            pm.add_hookspecs(hookspecs)
            _state.infos = []
            _state.broken = []
            _state.pm = pm
            if not _autoload_disabled():
                try:
                    _load_entry_points(pm)
                except Exception:
                    _state.pm = None
                    raise
        return _state.pm


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object by hand (tests, notebooks); returns its name.

    Clears the cached families and backends so the next query sees it.
    """
    pm = plugin_manager()
    with _state.lock:
        try:
            registered = pm.register(plugin, name=name)
        except ValueError as err:
            raise ConfigurationError(f"cannot register plugin {name!r}: {err}") from err
        if registered is None:
            raise ConfigurationError(f"plugin {name!r} is blocked or already registered.")
        _state.infos.append(PluginInfo(registered, None, None, repr(plugin)))
        _state.families = None
        _state.backends = None
        return registered


def reset_plugins() -> None:
    """Forget every plugin and cached result; the next query rediscovers entry points."""
    with _state.lock:
        _state.pm = None
        _state.infos = []
        _state.broken = []
        _state.families = None
        _state.backends = None


def plugins() -> list[PluginInfo]:
    """The plugins currently registered, in load order."""
    plugin_manager()
    return list(_state.infos)


def broken_plugins() -> list[BrokenPlugin]:
    """Entry points that failed to import (each was skipped with a warning)."""
    plugin_manager()
    return list(_state.broken)


def _collect(results: list[Any], kind: type, hook: str) -> list[Any]:
    out = []
    for res in results:
        if res is None:
            continue
        if isinstance(res, (str, bytes)) or not isinstance(res, Iterable):
            raise InputTypeError(f"{hook} must return an iterable of {kind.__name__}, got {res!r}.")
        for item in res:
            if not isinstance(item, kind):
                raise InputTypeError(
                    f"{hook} returned {item!r}; expected {kind.__name__} instances."
                )
            out.append(item)
    return out


def model_families() -> dict[str, ModelFamily]:
    """All model families from all plugins, keyed by HF ``config.model_type``.

    Duplicate family names or model types across plugins raise ``ConfigurationError``.
    """
    pm = plugin_manager()
    with _state.lock:
        if _state.families is None:
            found: list[tuple[str, ModelFamily]] = []
            for impl in reversed(pm.hook.opake_model_families.get_hookimpls()):
                fams = _collect([impl.function()], ModelFamily, "opake_model_families")
                found.extend((impl.plugin_name, fam) for fam in fams)
            by_name: dict[str, str] = {}
            by_type: dict[str, tuple[str, ModelFamily]] = {}
            for plugin, fam in found:
                if fam.name in by_name:
                    raise ConfigurationError(
                        f"model family {fam.name!r} is registered twice: by plugin "
                        f"{by_name[fam.name]!r} and by plugin {plugin!r}. Uninstall one."
                    )
                by_name[fam.name] = plugin
                for mt in fam.model_types:
                    if mt in by_type:
                        other_plugin, other = by_type[mt]
                        raise ConfigurationError(
                            f"model_type {mt!r} is claimed by family {other.name!r} (plugin "
                            f"{other_plugin!r}) and by family {fam.name!r} (plugin {plugin!r})."
                        )
                    by_type[mt] = (plugin, fam)
            _state.families = {mt: fam for mt, (_, fam) in by_type.items()}
        return dict(_state.families)


def kernel_backends() -> dict[str, KernelBackend]:
    """All kernel backends from all plugins, keyed by name (duplicates raise)."""
    pm = plugin_manager()
    with _state.lock:
        if _state.backends is None:
            backends: dict[str, tuple[str, KernelBackend]] = {}
            for impl in reversed(pm.hook.opake_kernel_backends.get_hookimpls()):
                for be in _collect([impl.function()], KernelBackend, "opake_kernel_backends"):
                    if be.name in backends:
                        raise ConfigurationError(
                            f"kernel backend {be.name!r} is registered twice: by plugin "
                            f"{backends[be.name][0]!r} and by plugin {impl.plugin_name!r}."
                        )
                    backends[be.name] = (impl.plugin_name, be)
            _state.backends = {name: be for name, (_, be) in backends.items()}
        return dict(_state.backends)
