"""Let ``torch.compile`` trace through the patched ``disable_saved_tensors_hooks``.

Dynamo handles a fixed set of torch context managers natively, recognised by identity in a
table (``torch._dynamo.variables.torch.supported_ctx_manager_classes``) built when
``torch._dynamo`` is first imported, from the objects torch's modules hold at that moment.
``torch.func`` transforms enter ``torch.autograd.graph.disable_saved_tensors_hooks``, which the
``save_on_cpu`` patch replaces by a transform-aware wrapper (``_offload.py``); a compiled
transform therefore meets either the wrapper while the table knows only the stock function
(``torch._dynamo`` imported before the patch: ``Unsupported``), or, after the patch is
removed, the stock function while the table knows only the wrapper (``torch._dynamo`` imported
while it was installed).

:func:`register` keeps the table right for every order: while the patch is installed the
wrapper is in the table (Dynamo then traces the stock behaviour, which is also what the wrapper
does under compilation: no Opake ``save_on_cpu`` hooks are pushed inside a compiled region);
its undo puts the stock function back in and takes the wrapper out. Nothing is imported: a
table that does not exist yet will be built from whatever torch holds when it is.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["register"]

_LOG = logging.getLogger("opake.patches")
_MODULE = "torch._dynamo.variables.torch"
_TABLE = "supported_ctx_manager_classes"


def _table() -> dict[Any, Any] | None:
    module = sys.modules.get(_MODULE)
    table = getattr(module, _TABLE, None) if module is not None else None
    if module is not None and not isinstance(table, dict):
        _LOG.info(
            "torch.compile: %s.%s not found in this torch; compiled transforms under the "
            "save_on_cpu patch are not registered with Dynamo",
            _MODULE,
            _TABLE,
        )
        return None
    return table


def register(stock: Any, patched: Any) -> Callable[[], None]:
    """Put ``patched`` in Dynamo's context-manager table (if loaded); return the undo."""
    table = _table()
    added = table is not None and patched not in table
    if table is not None and added:
        table[patched] = None

    def undo() -> None:
        current = _table()
        if current is None:
            return
        if stock not in current:
            current[stock] = None
        if added or table is None:
            current.pop(patched, None)

    return undo
