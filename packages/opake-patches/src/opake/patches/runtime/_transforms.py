"""Which ``torch.func`` transforms are active right now (checked at every checkpoint call).

Reliable signals in torch 2.11-2.13:

* ``torch._C._functorch.maybe_current_level()`` is ``None`` outside every transform;
* ``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()`` lists the active
  interpreters, outermost first (``TransformType.Vmap``, ``Grad``, ``Jvp``, ``Functionalize``);
* ``GradInterpreter.prev_grad_mode()`` is the grad mode the transform found when it started.

Tensor wrapping (``is_functorch_wrapped_tensor``) is *not* a reliable signal: inputs of a
checkpointed region may be plain tensors (constants) while the region runs under ``grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransformStack", "transform_stack"]


@dataclass(frozen=True)
class TransformStack:
    """Summary of the active ``torch.func`` interpreters (outermost first)."""

    kinds: tuple[str, ...]
    outer_grad_mode: bool

    @property
    def active(self) -> bool:
        """True inside any vmap/grad/vjp/jvp transform."""
        return bool(self.kinds)

    @property
    def n_grad(self) -> int:
        """Number of reverse-mode levels (``grad``, ``vjp``, ``jacrev``, ...)."""
        return self.kinds.count("grad")

    @property
    def n_jvp(self) -> int:
        """Number of forward-mode levels (``jvp``, ``jacfwd``, ``hessian``'s inner level)."""
        return self.kinds.count("jvp")

    @property
    def needs_vmap_safe_checkpoint(self) -> bool:
        """Stock ``torch.utils.checkpoint`` fails here: a vmap or reverse-mode level is active."""
        return "grad" in self.kinds or "vmap" in self.kinds


_NAMES = {"Vmap": "vmap", "Grad": "grad", "Jvp": "jvp", "Functionalize": "functionalize"}


def transform_stack() -> TransformStack:
    """Inspect the active transforms.

    >>> import torch
    >>> transform_stack().active
    False
    >>> torch.func.vmap(lambda x: torch.tensor(transform_stack().kinds == ("vmap",)))(
    ...     torch.zeros(2)).tolist()
    [True, True]
    """
    import torch

    if torch._C._functorch.maybe_current_level() is None:
        return TransformStack((), torch.is_grad_enabled())
    from torch._functorch.pyfunctorch import GradInterpreter, retrieve_all_functorch_interpreters

    interpreters = retrieve_all_functorch_interpreters()
    kinds = tuple(_NAMES.get(i.key().name, i.key().name.lower()) for i in interpreters)
    outer_grad_mode = torch.is_grad_enabled()
    for interp in interpreters:
        if isinstance(interp, GradInterpreter):  # the interpreter of every TransformType.Grad
            outer_grad_mode = bool(interp.prev_grad_mode())
            break
    return TransformStack(kinds, outer_grad_mode)
