"""The Opake plugin contract (public and stable).

Third parties and Opake's own distributions register plugins under the entry-point group
``opake``. A plugin module implements hooks from :mod:`opake.core.plugins.hookspecs`, marked
with :data:`hookimpl`, returning frozen descriptors:

>>> from opake.core.plugins import KernelBackend, ModelFamily, hookimpl
>>> @hookimpl
... def opake_model_families():
...     return [ModelFamily("toy", ("toy",), apply="my_pkg.toy:apply")]

Queries: :func:`plugin_manager`, :func:`model_families` (keyed by ``model_type``),
:func:`kernel_backends` (keyed by name), :func:`select_kernel`, :func:`bookkeeping_rules`
(the plugins' book-keeping layer rules, keyed by name). ``OPAKE_DISABLE_PLUGIN_AUTOLOAD=1``
skips entry points; ``OPAKE_BLOCK_PLUGINS=name,other`` skips the named ones;
``OPAKE_KERNEL_BACKEND=name`` forces a kernel backend. Every plugin is validated against the
hookspecs when it loads (pluggy's ``check_pending``) and hooks are called through pluggy, so
an implementation receives only the arguments it names.
"""

from __future__ import annotations

import pluggy

from opake.core.plugins import hookspecs
from opake.core.plugins._descriptors import (
    KNOWN_DEVICES,
    PIECE_KINDS,
    BookkeepingRule,
    KernelBackend,
    ModelFamily,
)
from opake.core.plugins._manager import (
    BLOCK_PLUGINS_ENV,
    ENTRY_POINT_GROUP,
    BrokenPlugin,
    PluginInfo,
    blocked_plugins,
    bookkeeping_rule_origins,
    bookkeeping_rules,
    broken_plugins,
    kernel_backends,
    model_families,
    plugin_manager,
    plugins,
    register_plugin,
    reset_plugins,
    unregister_plugin,
)
from opake.core.plugins._select import (
    KERNEL_BACKEND_ENV,
    KernelChoice,
    device_type_of,
    select_kernel,
)

#: marker for hook implementations: ``@hookimpl def opake_model_families(): ...``
hookimpl = pluggy.HookimplMarker("opake")

__all__ = [
    "BLOCK_PLUGINS_ENV",
    "ENTRY_POINT_GROUP",
    "KERNEL_BACKEND_ENV",
    "KNOWN_DEVICES",
    "PIECE_KINDS",
    "BookkeepingRule",
    "BrokenPlugin",
    "KernelBackend",
    "KernelChoice",
    "ModelFamily",
    "PluginInfo",
    "blocked_plugins",
    "bookkeeping_rule_origins",
    "bookkeeping_rules",
    "broken_plugins",
    "device_type_of",
    "hookimpl",
    "hookspecs",
    "kernel_backends",
    "model_families",
    "plugin_manager",
    "plugins",
    "register_plugin",
    "reset_plugins",
    "select_kernel",
    "unregister_plugin",
]
