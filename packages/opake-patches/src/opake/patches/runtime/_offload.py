"""``save_on_cpu`` that keeps working when ``torch.func`` transforms run inside it.

Stock :class:`torch.autograd.graph.save_on_cpu` pushes saved-tensor hooks; ``torch.func.grad``
refuses to start while any are pushed ("don't yet support saved tensor hooks"). The patched
class below differs from stock in two places only:

* it also publishes an :class:`OffloadPolicy` (a context variable) that Opake's vmap-safe
  checkpoint reads: the inputs a checkpointed region saves (the inter-layer hidden states) go to
  CPU memory, pinned when ``pin_memory=True`` and CUDA exists, and come back for the backward;
* when a transform disables saved-tensor hooks (``torch.func.grad``/``vjp`` enter
  ``torch.autograd.graph.disable_saved_tensors_hooks``), the hooks of the innermost active
  Opake ``save_on_cpu`` contexts are suspended for the duration of the transform and restored
  afterwards, instead of raising. Hooks pushed by anyone else still raise as before.

Outside transforms, the stock hooks run unchanged, so plain autograd offloads every saved tensor
exactly as before. Inside a transform, tensors saved by ordinary operations cannot be
intercepted (functorch has no hook for them): only checkpointed regions' inputs are offloaded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.patches._patcher import tag

if TYPE_CHECKING:
    import torch
    from torch.autograd.graph import save_on_cpu as StockSaveOnCpu

__all__ = [
    "OffloadPolicy",
    "current_offload",
    "make_patched_disable",
    "make_patched_save_on_cpu",
]


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a vmap-safe checkpoint keeps its saved inputs between forward and backward."""

    pin_memory: bool

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Copy *t* to CPU memory (pinned, asynchronous copy when CUDA is available)."""
        if t.device.type == "cpu":
            return t
        import torch

        pin = self.pin_memory and torch.cuda.is_available() and t.device.type == "cuda"
        # a non-blocking device-to-host copy lands in pinned memory
        return t.to("cpu", non_blocking=pin)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy *t* back to *device* (asynchronous from pinned memory)."""
        if t.device == device:
            return t
        return t.to(device, non_blocking=self.pin_memory)


_OFFLOAD: contextvars.ContextVar[OffloadPolicy | None] = contextvars.ContextVar(
    "opake_offload", default=None
)
# hook pairs pushed by active patched save_on_cpu contexts, innermost last
_OUR_HOOKS: contextvars.ContextVar[tuple[tuple[Any, Any], ...]] = contextvars.ContextVar(
    "opake_offload_hooks", default=()
)


def current_offload() -> OffloadPolicy | None:
    """The offload policy of the innermost active (patched) ``save_on_cpu``, if any.

    >>> current_offload() is None
    True
    """
    return _OFFLOAD.get()


def make_patched_save_on_cpu(stock: type[StockSaveOnCpu]) -> type[StockSaveOnCpu]:
    """Build the drop-in subclass of the stock ``save_on_cpu`` class."""

    # mypy takes no base class chosen at run time (the class torch has now): one ignore
    class save_on_cpu(stock):  # type: ignore[misc, valid-type]  # noqa: N801 - torch's name
        __doc__ = stock.__doc__
        __module__ = stock.__module__
        __qualname__ = stock.__qualname__

        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            self._opake_policy = OffloadPolicy(pin_memory=bool(pin_memory))
            self._opake_tokens: list[tuple[Any, Any, bool]] = []

        def __enter__(self) -> None:
            import torch

            policy_token = _OFFLOAD.set(self._opake_policy)
            # private and missing from torch's stubs (runtime._state checks that it exists)
            pushed = bool(torch._C._autograd._saved_tensors_hooks_is_enabled())  # type: ignore[attr-defined]
            hooks_token = None
            if pushed:  # outside transforms: the stock behaviour
                super().__enter__()
                pair = (self.pack_hook, self.unpack_hook)
                hooks_token = _OUR_HOOKS.set((*_OUR_HOOKS.get(), pair))
            self._opake_tokens.append((policy_token, hooks_token, pushed))

        def __exit__(self, *args: object) -> None:
            policy_token, hooks_token, pushed = self._opake_tokens.pop()
            if pushed:
                super().__exit__(*args)
                _OUR_HOOKS.reset(hooks_token)
            _OFFLOAD.reset(policy_token)

    return save_on_cpu


def make_patched_disable(
    stock: Callable[[str], contextlib.AbstractContextManager[None]],
) -> Callable[[str], contextlib.AbstractContextManager[None]]:
    """Wrap ``disable_saved_tensors_hooks`` so it suspends Opake's save_on_cpu hooks."""

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
        import torch

        if torch.compiler.is_compiling():  # torch.compile traces the stock behaviour: no
            # save_on_cpu hooks of Opake's are pushed inside a compiled region (Dynamo cannot
            # read their ContextVar either)
            with stock(error_message):
                yield
            return
        ours = list(_OUR_HOOKS.get())
        suspended: list[tuple[Any, Any]] = []
        while ours:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is None or (top[0], top[1]) != ours[-1]:
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
            suspended.append(ours.pop())
        try:
            with stock(error_message):
                yield
        finally:
            for pack, unpack in reversed(suspended):
                torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)

    disable_saved_tensors_hooks.__doc__ = stock.__doc__
    tag(disable_saved_tensors_hooks, "__wrapped__", stock)
    return disable_saved_tensors_hooks
