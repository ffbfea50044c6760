"""Activation checkpointing that works inside ``torch.func.grad`` and ``vmap(grad(...))``.

Stock ``torch.utils.checkpoint`` cannot run there: the non-reentrant path relies on saved-tensor
hooks (which ``torch.func.grad`` disables) and the reentrant path is an ``autograd.Function``
without ``setup_context``. :func:`vmap_checkpoint` is a ``setup_context`` Function instead:

* ``forward`` runs the region once without building a graph;
* ``setup_context`` saves only the region's inputs (the explicit arguments, the tensors the
  callable captured, and the parameters/buffers of the modules it reaches — see
  :mod:`opake.patches.runtime._lift`), optionally offloaded to the CPU;
* ``backward`` restores the RNG state, recomputes the region with ``torch.func.vjp`` **inside
  ``torch.no_grad()``** (otherwise the outer level records the recomputation and nothing is
  saved) and returns the vector-Jacobian products;
* ``generate_vmap_rule = True`` lets ``vmap`` batch it.

Because ``backward`` runs under ``no_grad``, its result cannot be differentiated again: a second
reverse-mode level, a forward-mode level, or a differentiable outer autograd graph raise
:class:`~opake.core.errors.OperationError` instead of returning wrong higher-order derivatives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from opake.core.errors import OperationError
from opake.functional import cached_signature
from opake.patches.runtime._lift import LiftedCall, lift_call
from opake.patches.runtime._offload import OffloadPolicy, current_offload
from opake.patches.runtime._transforms import TransformStack, transform_stack

if TYPE_CHECKING:
    import torch

__all__ = ["CHECKPOINT_OPTIONS", "check_checkpoint_context", "vmap_checkpoint"]

#: keyword arguments ``torch.utils.checkpoint.checkpoint`` consumes itself (not the function's)
CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "preserve_rng_state",
)

_CLOSURE_HINT = (
    "The checkpointed callable captured a tensor that Opake could not reach. Opake lifts tensors "
    "out of the positional/keyword arguments, functools.partial objects, bound methods, closure "
    "cells and the parameters/buffers of reachable nn.Modules; a tensor stored on some other "
    "object (or a tensor global) stays hidden. Pass it to checkpoint() as an argument instead."
)


_COMPILE_MESSAGE = (
    "torch.compile cannot be wrapped around checkpointed regions inside torch.func transforms: "
    "compiled activation checkpointing relies on saved-tensor hooks, which AOTAutograd cannot "
    "compose with vmap(grad(...)), and Opake's vmap-safe checkpoint recomputes inside a custom "
    "autograd.Function's backward, which the compiler cannot trace. Run the checkpointed "
    "functional transform eagerly, or compile a function without checkpointing."
)


def _from_compiled_graph(function: Callable[..., Any], context_fn: Any) -> bool:
    """True when torch.compile's checkpoint operator replays a compiled region through us."""
    for obj in (function, context_fn, getattr(function, "__self__", None)):
        if obj is None:
            continue
        qualname = getattr(obj, "__qualname__", "") or type(obj).__qualname__
        module = getattr(obj, "__module__", "") or type(obj).__module__
        if "tag_activation_checkpoint" in qualname or module.startswith("torch.fx.interpreter"):
            return True
    return False


def _base_requires_grad(tensors: Sequence[torch.Tensor]) -> bool:
    """True if any tensor, unwrapped down to the level below every transform, requires grad."""
    import torch

    for t in tensors:
        base = t
        while torch._C._functorch.is_functorch_wrapped_tensor(base):
            base = torch._C._functorch.get_unwrapped(base)
        if base.requires_grad:
            return True
    return False


def check_checkpoint_context(
    stack: TransformStack, tensors: Sequence[torch.Tensor] | None = None
) -> None:
    """Raise :class:`OperationError` where a vmap-safe checkpoint would give wrong results.

    Raised for: tracing by ``torch.compile``; a forward-mode level; two or more reverse-mode
    levels; one reverse-mode level started with grad mode on while a tensor of the region
    requires grad below every transform (the outer autograd graph could then differentiate the
    per-example gradients again).
    """
    import torch

    if torch.compiler.is_compiling():
        raise OperationError(_COMPILE_MESSAGE)
    if stack.n_jvp:
        raise OperationError(
            "forward-mode differentiation (torch.func.jvp / jacfwd / hessian) through a "
            f"checkpointed region is not supported (active transforms: {stack.kinds}). Opake's "
            "vmap-safe checkpoint has a reverse-mode rule only; remove the checkpoint for this "
            "call."
        )
    outer = (
        stack.n_grad == 1
        and stack.outer_grad_mode
        and tensors is not None
        and _base_requires_grad(tensors)
    )
    if stack.n_grad > 1 or outer:
        where = (
            f"{stack.n_grad} nested reverse-mode transforms"
            if stack.n_grad > 1
            else "grad mode was enabled outside the torch.func transform and a tensor of the "
            "region requires grad there"
        )
        raise OperationError(
            "higher-order differentiation through a checkpointed region is not supported "
            f"({where}; active transforms: {stack.kinds}). The recomputation runs under "
            "torch.no_grad() so that it really saves memory, which makes its gradients constants "
            "for any outer differentiation. Call vmap(grad(...)) inside `with torch.no_grad():` "
            "(clipped_grad does this for you), or remove the checkpoint for higher-order use."
        )


def _context_is_differentiated(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the ``setup_context`` running now saves the tensors ``backward`` will read.

    Under transforms ``setup_context`` runs once per level; only the innermost reverse-mode
    level's context is used by ``backward`` (the others are dropped once the forward returns),
    so only that one pays for the copies to the host. Below every reverse-mode level, plain
    autograd uses the context only if it records a graph.
    """
    import torch

    kinds = transform_stack().kinds
    if "grad" in kinds:
        return kinds[-1] == "grad"
    # below every reverse-mode level: only plain autograd can use this context
    return torch.is_grad_enabled() and _base_requires_grad(tensors)


def _unwrap_dead(t: torch.Tensor) -> torch.Tensor:
    """Peel wrappers whose transform level has already exited.

    ``vmap(vjp(f))`` runs the backward after ``vjp``'s level is gone: the saved tensors are then
    dead level wrappers. Recomputing through them trips functorch's dispatcher, so the backward
    works on what they wrap (a tensor of a still-active level, or a plain tensor).
    """
    import torch

    while torch._C._functorch.maybe_get_level(t) == _DEAD_LEVEL:
        t = torch._C._functorch.get_unwrapped(t)
    return t


_DEAD_LEVEL = -2  # what torch._C._functorch.maybe_get_level reports for a dead wrapper

_T = TypeVar("_T")


@dataclass
class _Region(Generic[_T]):
    """Everything one checkpointed call needs between forward and backward (``_T``: what the
    checkpointed function returns)."""

    lifted: LiftedCall
    offload: OffloadPolicy | None
    rng: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)
    tensor_positions: list[int] = field(default_factory=list)
    float_outputs: list[int] = field(default_factory=list)
    devices: list[Any] = field(default_factory=list)

    # -- outputs ---------------------------------------------------------------------------
    def flatten(self, out: object, *, record: bool) -> tuple[torch.Tensor, ...]:
        import torch
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten(out)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if record:
            self.out_spec = spec
            self.out_leaves = list(leaves)
            self.tensor_positions = positions
            self.float_outputs = [
                k
                for k, i in enumerate(positions)
                if leaves[i].is_floating_point() or leaves[i].is_complex()
            ]
        elif positions != self.tensor_positions:
            raise OperationError(
                "a checkpointed region returned a different output structure when it was "
                "recomputed for the backward pass; checkpointed functions must be deterministic "
                "in their output structure."
            )
        return tuple(leaves[i] for i in positions)

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> _T:
        from torch.utils import _pytree as pytree

        leaves = list(self.out_leaves)
        for pos, t in zip(self.tensor_positions, tensors, strict=True):
            leaves[pos] = t
        self.out_leaves = []  # do not keep the forward outputs alive
        out: _T = pytree.tree_unflatten(leaves, self.out_spec)  # the structure flatten took apart
        return out

    # -- saving ----------------------------------------------------------------------------
    def pack(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.devices = [t.device for t in tensors]
        if self.offload is None or not _context_is_differentiated(tensors):
            return list(tensors)
        n_state = self.lifted.n_state
        return [
            t if i < n_state else self.offload.to_host(t)  # weights stay where they are
            for i, t in enumerate(tensors)
        ]

    def unpack(self, saved: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [_unwrap_dead(t) for t in saved]
        if self.offload is None:
            return tensors
        return [self.offload.to_device(t, d) for t, d in zip(tensors, self.devices, strict=True)]

    # -- recomputation ---------------------------------------------------------------------
    @contextlib.contextmanager
    def replay_rng(self) -> Iterator[None]:
        if self.rng is None:
            yield
            return
        import torch
        from torch.utils.checkpoint import set_device_states

        cpu_state, devices, states = self.rng
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(cpu_state)
            if devices:
                set_device_states(devices, states)
            yield

    def backward(
        self,
        needs: Sequence[bool],
        tensors: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        import torch

        diff = [
            i
            for i, (need, t) in enumerate(zip(needs, tensors, strict=True))
            if need and (t.is_floating_point() or t.is_complex())
        ]
        result: list[torch.Tensor | None] = [None] * len(tensors)
        if not diff or not self.float_outputs:
            return result

        def recompute(*primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
            current = list(tensors)
            for i, p in zip(diff, primals, strict=True):
                current[i] = p
            outs = self.flatten(self.lifted.call(current), record=False)
            return tuple(outs[k] for k in self.float_outputs)

        with torch.no_grad(), self.replay_rng():
            vjp_fn = torch.func.vjp(recompute, *(tensors[i] for i in diff))[1]
            cotangents = tuple(grads[k] for k in self.float_outputs)
            vjps = vjp_fn(cotangents)
        for i, g in zip(diff, vjps, strict=True):
            result[i] = g
        return result


class _CheckpointFunction(Protocol):
    """The vmap-safe checkpoint's ``autograd.Function`` class, as called here (torch leaves
    ``Function.apply`` untyped): a tensor or a tuple of tensors, the region's tensor outputs."""

    def apply(
        self, region: _Region[Any], *tensors: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def _function_class() -> type[torch.autograd.Function]:
    import torch

    @cached_signature
    class _VmapCheckpoint(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(region: _Region[Any], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = region.lifted.call(tensors)
            flat = region.flatten(out, record=True)
            # an output that *is* an input would alias a saved tensor: return a copy instead
            ids = {id(t) for t in tensors}
            return tuple(t.clone() if id(t) in ids else t for t in flat)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            region = inputs[0]
            ctx.region = region
            ctx.save_for_backward(*region.pack(inputs[1:]))

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            region: _Region[Any] = ctx.region
            tensors = region.unpack(ctx.saved_tensors)
            return (None, *region.backward(ctx.needs_input_grad[1:], tensors, grads))

    return _VmapCheckpoint


_FUNCTION: list[_CheckpointFunction] = []


def _checkpoint_function() -> _CheckpointFunction:
    if not _FUNCTION:
        _FUNCTION.append(_function_class())
    return _FUNCTION[0]


def vmap_checkpoint(
    function: Callable[..., _T],
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], Any] | None = None,
    **kwargs: Any,
) -> _T:
    """Checkpoint ``function(*args, **kwargs)`` in a way ``torch.func`` transforms accept.

    This is what the patched ``torch.utils.checkpoint.checkpoint`` calls inside a transform (any
    ``use_reentrant`` value); it also works outside transforms. ``context_fn`` (selective
    checkpointing) is not supported here; ``determinism_check``, ``debug`` and ``early_stop`` are
    accepted and have no effect.

    Example:
        >>> import torch
        >>> from torch.func import grad, vmap
        >>> lin = torch.nn.Linear(3, 3)
        >>> f = lambda x: vmap_checkpoint(lin, x).pow(2).sum()
        >>> x = torch.randn(2, 3)
        >>> with torch.no_grad():
        ...     g = vmap(grad(f))(x)
        >>> ref = vmap(grad(lambda x: lin(x).pow(2).sum()))(x)
        >>> torch.allclose(g, ref)
        True
    """
    import torch

    if torch.compiler.is_compiling():
        raise OperationError(_COMPILE_MESSAGE)
    if _from_compiled_graph(function, context_fn):
        # a compiled graph replays the transforms' disable_saved_tensors_hooks as plain calls,
        # without a finally: raising here would leave saved-tensor hooks disabled for the whole
        # process (every later save_on_cpu would silently stop offloading)
        torch._C._autograd._saved_tensors_hooks_enable()
        raise OperationError(_COMPILE_MESSAGE)
    if context_fn is not None and not _is_noop_context_fn(context_fn):
        raise OperationError(
            "checkpoint(context_fn=...) (selective activation checkpointing) is not supported "
            "inside torch.func transforms; drop context_fn to checkpoint the whole region."
        )
    for name in ("use_reentrant", "determinism_check", "debug", "early_stop"):
        kwargs.pop(name, None)
    lifted = lift_call(function, args, kwargs)
    check_checkpoint_context(transform_stack(), lifted.tensors)
    rng = None
    if preserve_rng_state:
        from torch.utils.checkpoint import get_device_states

        devices, states = get_device_states(*lifted.tensors)
        rng = (torch.get_rng_state(), devices, states)
    region: _Region[_T] = _Region(lifted=lifted, offload=current_offload(), rng=rng)
    inputs, lifted.tensors = lifted.tensors, []  # the saved (maybe offloaded) copies only
    try:
        flat = _checkpoint_function().apply(region, *inputs)
    except RuntimeError as err:
        text = str(err)
        if "wrapper == nullptr" in text or ("INTERNAL ASSERT" in text and "functorch" in text):
            raise OperationError(f"{_CLOSURE_HINT} (torch said: {text.splitlines()[0]})") from err
        raise
    finally:
        del inputs
    if not isinstance(flat, tuple):
        flat = (flat,)
    return region.unflatten(flat)


def _is_noop_context_fn(fn: Callable[[], Any]) -> bool:
    from torch.utils.checkpoint import noop_context_fn

    return fn is noop_context_fn
