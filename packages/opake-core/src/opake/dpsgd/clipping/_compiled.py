"""``torch.compile`` support: what ``grad_fn`` does differently while Dynamo traces it.

``torch.compile(grad_fn, fullgraph=True)`` traces :meth:`ClippedGradFn.__call__` with the vmap
engine into one graph. Eager calls never take these paths (bit for bit unchanged); under
:func:`compiling` the Python-level steps Dynamo cannot trace are replaced by traceable ones of
the same math:

- **no outer transform.** Eager ``grad_fn`` asks functorch's interpreter stack whether an outer
  ``torch.func.grad``/``jvp`` differentiates through it. A compiled call cannot be inside one
  (``torch.func.grad(torch.compile(f))`` from eager is refused by torch itself, pytorch#128711),
  so a compiled call is never differentiable: it runs under ``no_grad``.
- **the certified norms, as they are.** :func:`opake.dpsgd.certify.dense_sq_norms` recomputes
  in fp64 the rows whose fp32 block norms overflow, after a ``bool(...)`` test Dynamo cannot
  trace. The compiled graph calls it as an opaque operator (``torch.ops.opake.
  certified_sq_norms``, :func:`register`): the very eager code the proof covers, bit for bit
  the eager norms, with the host sync eager calls also make. It also returns a copy of the
  buffer it measured, and the compiled sum reads that copy (see :func:`sq_norms`). Everything
  around it (the per-example gradients, the factors, the weighted sums) is compiled; those
  parts of the proof hold for any reduction order or blocking, with or without fused
  multiply-adds (docs/guide/clipping-proof.md, assumption 2), so Inductor's fused, reordered
  reductions keep the bound.
- **full precision without global state.** Eager code switches autocast off and the fp32
  matmul precision to ``"highest"`` around the norms and sums (:func:`full_precision`); a
  graph cannot set the matmul precision, so the compiled path switches autocast off and forms
  the weighted sums as products and sums (no matrix product: TF32 cannot apply).
- **refused.** Privacy units (``units=``: the plan sizes chunks on the host), the book-keeping
  engine (forward/backward hooks, a ``ContextVar`` of taps and host-side checks) and the
  expanded-forward path (``torch.autograd.grad``) do not trace. ``engine="bookkeeping"`` and
  ``units=`` raise :class:`~opake.core.errors.OperationError` while tracing: with
  ``fullgraph=True`` torch reports it as ``Unsupported`` naming this error; without it, Dynamo
  runs the call eagerly (which works). ``engine="auto"`` uses the vmap engine when compiled.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from opake.core.errors import OperationError
from opake.dpsgd.certify import dense_sq_norms

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

__all__ = ["compiling", "precision", "refuse", "register", "sq_norms"]


def compiling() -> bool:
    """Whether Dynamo is tracing this call (``torch.compile``)."""
    import torch

    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def refuse(what: str, why: str) -> OperationError:
    """The error a compiled ``grad_fn`` raises for something that does not trace."""
    return OperationError(
        f"torch.compile(grad_fn): {what} cannot be compiled ({why}); call grad_fn without "
        "torch.compile, or compile without fullgraph=True (Dynamo then runs such calls eagerly)"
    )


def precision(device: torch.device) -> AbstractContextManager[None]:
    """:func:`opake.dpsgd.certify.full_precision` eagerly; autocast off while compiling."""
    from opake.dpsgd.certify import full_precision

    if not compiling():
        return full_precision()
    import torch

    if device.type in {"cpu", "cuda"}:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def sq_norms(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~opake.dpsgd.certify.dense_sq_norms` of ``flat`` and the tensor to sum: ``flat``
    itself eagerly; when compiling, the same function as an opaque operator (:func:`register`)
    that also returns a copy of the very buffer it measured.

    The copy is what the compiled weighted sum reads. A compiled graph may otherwise compute a
    tensor it uses twice in two ways — e.g. fuse the sum with the per-example gradient's
    producer, recomputing it from its fp32 inputs without the bf16 rounding the measured
    buffer had (Inductor does not emulate low-precision casts inside a fused kernel) — and the
    clipping proof needs the summed tensor to be the measured one (assumption 4). An opaque
    operator's output cannot be recomputed: the sum reads what was measured, in any dtype.
    """
    if compiling():
        import torch

        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        out = torch.ops.opake.certified_sq_norms(flat)
        return out
    hat, up = dense_sq_norms(flat)
    return hat, up, flat


def register() -> None:
    """Register ``torch.ops.opake.certified_sq_norms`` once (eagerly, before any trace)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch

    if not hasattr(torch.ops.opake, "certified_sq_norms"):
        schema = "(Tensor x) -> (Tensor, Tensor, Tensor)"

        @torch.library.custom_op("opake::certified_sq_norms", mutates_args=(), schema=schema)
        def certified_sq_norms(
            x: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hat, up = dense_sq_norms(x)
            return hat, up, x.clone()  # an output may not alias an input

        @certified_sq_norms.register_fake
        def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            shape = (x.shape[0],) if x.dim() else (1,)
            empty = x.new_empty(shape, dtype=torch.float64)
            return empty, torch.empty_like(empty), torch.empty_like(x)

    _REGISTERED = True


_REGISTERED = False
