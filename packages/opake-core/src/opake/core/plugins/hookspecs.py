"""The hook specifications of the ``opake`` plugin system (the one place they are defined).

A plugin is a module (or object) registered under the entry-point group ``opake``::

    [project.entry-points.opake]
    my_plugin = "my_package.opake_plugin"

whose functions are marked with :data:`opake.core.plugins.hookimpl`. Specs only ever gain
optional arguments, so an implementation written against an older version keeps working: hooks
are called through pluggy, which passes an implementation only the arguments it names. A plugin
is validated when it loads (pluggy's ``check_pending``): an ``opake_*`` function that no spec
defines is an error (the plugin is skipped with a warning), unless it is marked
``@hookimpl(optionalhook=True)`` — the way to implement a hook of a newer Opake and still load
on an older one.
The rest of Opake never calls these hooks directly; it uses the typed queries in
:mod:`opake.core.plugins` (``model_families()``, ``kernel_backends()``,
``bookkeeping_rules()``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from opake.core.plugins._descriptors import BookkeepingRule, KernelBackend, ModelFamily

__all__ = [
    "hookspec",
    "opake_bookkeeping_rules",
    "opake_kernel_backends",
    "opake_model_families",
]

#: marker for hook specifications of project ``opake``
hookspec = pluggy.HookspecMarker("opake")


@hookspec
def opake_model_families() -> Iterable[ModelFamily]:
    """Return the Hugging Face model families this plugin can patch.

    Called once, the first time :func:`opake.core.plugins.model_families` is queried after
    plugins are loaded (results are cached until the plugin manager is reset).

    Returns:
        An iterable of :class:`~opake.core.plugins.ModelFamily`. Family names and each
        ``model_type`` must be unique across all plugins; a clash raises
        :class:`~opake.core.errors.ConfigurationError` naming both plugins.

    Since: 0.1.0
    """
    raise NotImplementedError  # a specification: pluggy calls the implementations, never this


@hookspec
def opake_kernel_backends() -> Iterable[KernelBackend]:
    """Return the kernel backends this plugin provides.

    Called once, the first time :func:`opake.core.plugins.kernel_backends` is queried after
    plugins are loaded (results are cached until the plugin manager is reset).

    Returns:
        An iterable of :class:`~opake.core.plugins.KernelBackend`. Backend names must be unique
        across all plugins; a clash raises :class:`~opake.core.errors.ConfigurationError`.

    Since: 0.1.0
    """
    raise NotImplementedError  # a specification: pluggy calls the implementations, never this


@hookspec
def opake_bookkeeping_rules() -> Iterable[BookkeepingRule]:
    """Return the book-keeping layer rules this plugin provides (for its own layers).

    Called once, the first time :func:`opake.core.plugins.bookkeeping_rules` is queried after
    plugins are loaded (results are cached until the plugin manager is reset). The book-keeping
    engine tries them with its built-in rules, highest priority first; a generated conformance
    test runs every registered rule's ``example`` against a per-example autograd loop.

    Returns:
        An iterable of :class:`~opake.core.plugins.BookkeepingRule`. Rule names must be unique
        across all plugins and the built-in rules; a clash raises
        :class:`~opake.core.errors.ConfigurationError` naming both.

    Since: 0.1.0
    """
    raise NotImplementedError  # a specification: pluggy calls the implementations, never this
