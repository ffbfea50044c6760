"""Plugin discovery (entry points in group ``opake``) and the typed queries over hooks."""

from __future__ import annotations

import logging
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
from opake.core.plugins._descriptors import BookkeepingRule, KernelBackend, ModelFamily

__all__ = [
    "BLOCK_PLUGINS_ENV",
    "ENTRY_POINT_GROUP",
    "BrokenPlugin",
    "PluginInfo",
    "blocked_plugins",
    "bookkeeping_rule_origins",
    "bookkeeping_rules",
    "broken_plugins",
    "kernel_backends",
    "model_families",
    "plugin_manager",
    "plugins",
    "register_plugin",
    "reset_plugins",
    "unregister_plugin",
]

#: the entry-point group every plugin (first- and third-party) registers under
ENTRY_POINT_GROUP = "opake"
_DISABLE_ENV = "OPAKE_DISABLE_PLUGIN_AUTOLOAD"
#: comma-separated entry-point names of plugins never to load (a broken or unwanted plugin)
BLOCK_PLUGINS_ENV = "OPAKE_BLOCK_PLUGINS"

_log = logging.getLogger("opake.core")


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
        self.blocked: list[str] = []
        self.families: dict[str, ModelFamily] | None = None
        self.backends: dict[str, KernelBackend] | None = None
        self.rules: dict[str, BookkeepingRule] | None = None
        self.rule_origins: dict[str, str | None] = {}


_state = _State()


def _autoload_disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _blocked_names() -> list[str]:
    raw = os.environ.get(BLOCK_PLUGINS_ENV, "")
    return sorted({name.strip() for name in raw.split(",") if name.strip()})


def _validated_register(pm: pluggy.PluginManager, obj: object, name: str | None) -> str | None:
    """Register *obj* and check it against the hookspecs (``check_pending``), all or nothing.

    A hook implementation with a signature the spec does not allow, or one named like a hook
    (``opake_*``) that no spec defines (a typo, or a hook of a newer Opake), raises
    ``pluggy.PluginValidationError``; the plugin is then unregistered again.
    """
    registered = pm.register(obj, name=name)
    if registered is None:
        return None
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pm.unregister(name=registered)
        raise
    return registered


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    seen: dict[str, PluginInfo] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist_name, dist_version = _dist_of(ep)
        if ep.name in _state.blocked:
            _log.info(
                "plugin %r (%s, from %s) is blocked by %s",
                ep.name,
                ep.value,
                dist_name,
                BLOCK_PLUGINS_ENV,
            )
            continue
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
            if _validated_register(pm, obj, ep.name) is None:  # pragma: no cover - blocked above
                continue
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
        _state.infos.append(info)
        _log.debug("loaded plugin %r (%s, from %s %s)", ep.name, ep.value, dist_name, dist_version)


def plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first use.

    Set ``OPAKE_DISABLE_PLUGIN_AUTOLOAD=1`` to skip entry points (only plugins registered
    with :func:`register_plugin` are then used), and ``OPAKE_BLOCK_PLUGINS=name,other`` to
    skip the entry points of those names (:func:`blocked_plugins` lists them). Each plugin is
    validated against the hookspecs when it is loaded (``check_pending``): one that
    implements a hook no spec defines, or with arguments its spec does not have, is skipped
    with a warning and listed by :func:`broken_plugins`.

    >>> plugin_manager().project_name
    'opake'
    """
    with _state.lock:
        if _state.pm is None:
            pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
            pm.add_hookspecs(hookspecs)
            _state.infos = []
            _state.broken = []
            _state.blocked = _blocked_names()
            for name in _state.blocked:
                pm.set_blocked(name)
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

    The plugin is validated against the hookspecs first: an unknown ``opake_*`` hook or a
    signature its spec does not allow raises :class:`~opake.core.errors.ConfigurationError`
    and nothing is registered. Clears the cached families and backends so the next query
    sees it.
    """
    pm = plugin_manager()
    with _state.lock:
        try:
            registered = _validated_register(pm, plugin, name)
        except (ValueError, pluggy.PluginValidationError) as err:
            raise ConfigurationError(
                f"cannot register plugin {name!r}: {err}. Check its hook names and arguments "
                "against opake.core.plugins.hookspecs."
            ) from err
        if registered is None:
            raise ConfigurationError(f"plugin {name!r} is blocked or already registered.")
        _state.infos.append(PluginInfo(registered, None, None, repr(plugin)))
        _state.families = None
        _state.backends = None
        _state.rules = None
        return registered


def unregister_plugin(name: str) -> None:
    """Unregister the plugin :func:`register_plugin` registered as ``name`` (tests, notebooks).

    Clears the cached families, backends and rules so the next query no longer sees it; an
    unknown name raises :class:`~opake.core.errors.ConfigurationError`.

    >>> class Empty:
    ...     pass
    >>> name = register_plugin(Empty(), "doc-empty")
    >>> unregister_plugin(name)
    >>> "doc-empty" in [info.name for info in plugins()]
    False
    """
    pm = plugin_manager()
    with _state.lock:
        if pm.get_plugin(name) is None:
            raise ConfigurationError(
                f"no plugin named {name!r} is registered; registered: "
                f"{[info.name for info in _state.infos]}."
            )
        pm.unregister(name=name)
        _state.infos = [info for info in _state.infos if info.name != name]
        _state.families = None
        _state.backends = None
        _state.rules = None


def reset_plugins() -> None:
    """Forget every plugin and cached result; the next query rediscovers entry points."""
    with _state.lock:
        _state.pm = None
        _state.infos = []
        _state.broken = []
        _state.blocked = []
        _state.families = None
        _state.backends = None
        _state.rules = None


def plugins() -> list[PluginInfo]:
    """The plugins currently registered, in load order."""
    plugin_manager()
    return list(_state.infos)


def broken_plugins() -> list[BrokenPlugin]:
    """Entry points that failed to import (each was skipped with a warning)."""
    plugin_manager()
    return list(_state.broken)


def blocked_plugins() -> list[str]:
    """Entry-point names skipped because ``OPAKE_BLOCK_PLUGINS`` names them."""
    plugin_manager()
    return list(_state.blocked)


def _per_plugin(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, Any]]:
    """Call *hook* through pluggy once per implementing plugin, in pluggy's call order.

    Each call goes through pluggy's own hook caller (so an implementation receives only the
    arguments it names, and specs can grow optional arguments), restricted to one plugin so
    every result can be attributed to the plugin that returned it.
    """
    impls = getattr(pm.hook, hook).get_hookimpls()
    out = []
    for impl in reversed(impls):  # pluggy calls the last registered first
        others = [other.plugin for other in impls if other is not impl]
        caller = pm.subset_hook_caller(hook, remove_plugins=others)
        out.append((impl.plugin_name, caller()))
    return out


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
            for plugin, results in _per_plugin(pm, "opake_model_families"):
                fams = _collect(results, ModelFamily, "opake_model_families")
                found.extend((plugin, fam) for fam in fams)
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
            for plugin, results in _per_plugin(pm, "opake_kernel_backends"):
                for be in _collect(results, KernelBackend, "opake_kernel_backends"):
                    if be.name in backends:
                        raise ConfigurationError(
                            f"kernel backend {be.name!r} is registered twice: by plugin "
                            f"{backends[be.name][0]!r} and by plugin {plugin!r}."
                        )
                    backends[be.name] = (plugin, be)
            _state.backends = {name: be for name, (_, be) in backends.items()}
        return dict(_state.backends)


def bookkeeping_rules() -> dict[str, BookkeepingRule]:
    """The book-keeping layer rules of all plugins, keyed by name (duplicates raise).

    The engine's own rules are not among them: ``opake.dpsgd.bookkeeping.registered_rules()``
    gives the built-in and the plugins' rules together, in the order they are tried.
    """
    pm = plugin_manager()
    with _state.lock:
        if _state.rules is None:
            rules: dict[str, tuple[str, BookkeepingRule]] = {}
            for plugin, results in _per_plugin(pm, "opake_bookkeeping_rules"):
                for rule in _collect(results, BookkeepingRule, "opake_bookkeeping_rules"):
                    if rule.name in rules:
                        raise ConfigurationError(
                            f"book-keeping rule {rule.name!r} is registered twice: by plugin "
                            f"{rules[rule.name][0]!r} and by plugin {plugin!r}."
                        )
                    rules[rule.name] = (plugin, rule)
            _state.rules = {name: rule for name, (_, rule) in rules.items()}
            dists = {info.name: info.distribution for info in _state.infos}
            _state.rule_origins = {name: dists.get(plugin) for name, (plugin, _) in rules.items()}
        return dict(_state.rules)


def bookkeeping_rule_origins() -> dict[str, str | None]:
    """The distribution that registered each plugin rule (``None``: registered in code).

    >>> isinstance(bookkeeping_rule_origins(), dict)
    True
    """
    bookkeeping_rules()
    with _state.lock:
        return dict(_state.rule_origins)
