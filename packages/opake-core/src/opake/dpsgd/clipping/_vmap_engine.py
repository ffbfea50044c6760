"""The vmap engine: per-example gradients by ``torch.func``, then the factor-weighted sum.

Per-example gradients are computed as ``vmap`` over :func:`torch.func.vjp` rather than
:func:`torch.func.grad`. ``grad`` always runs its backward with ``create_graph=True``; a vjp's
backward follows grad mode, so under the ``no_grad`` the caller installs it records no
differentiable graph, and inside an outer differentiating ``torch.func`` transform it records
the graph that transform needs. The two agree to fp32 rounding; on CPU with torch 2.13 their
speed and peak memory under ``vmap`` were the same within noise (``python
tools/bench/dpsgd_step.py --engines``; figures in docs/benchmarks.md).

When the differentiated parameters are a small part of the model (LoRA adapters next to a
frozen model), the functorch backward's per-operation overhead dominates. There the
per-example gradients come instead from a ``vmap``-ed *forward* over the differentiated
parameters expanded to a batch dimension (stride-0 views, no copy) and one ordinary
``torch.autograd.grad`` of the summed per-example losses: example ``i``'s loss depends only on
copy ``i``, so the gradient w.r.t. copy ``i`` is example ``i``'s gradient, and the backward runs
on plain batched tensors. The choice only changes speed (both paths are tested against the
per-example loop); the expanded path is dropped for good if it ever fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.certify import ETA, FINAL
from opake.dpsgd.clipping._chunks import ChunkOut
from opake.dpsgd.clipping._compiled import compiling, precision, sq_norms
from opake.dpsgd.clipping._kernel import clip_accumulate, kernel_runs_on

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._units import RowUnits
    from opake.dpsgd.clipping._base import ClipFactors

__all__ = [
    "VmapEngine",
    "argument_numel",
    "checked_loss",
    "model_numel",
    "small_fraction",
]

# expanded-forward path when differentiated numel ≤ this fraction of the rest of the model
_EXPAND_FRACTION = 0.1
#: a chunk's per-example gradients by leaf name ``[m, ...]``, losses ``[m]``, and the loss's
#: aux stacked over the chunk (``None`` without ``has_aux``)
_PerExample = tuple[dict[str, "torch.Tensor"], "torch.Tensor", object]


def small_fraction(diff_numel: int, other_numel: int) -> bool:
    """Whether ``diff_numel`` differentiated numbers are a small part next to ``other_numel``."""
    return diff_numel <= _EXPAND_FRACTION * other_numel


def argument_numel(args: tuple[Any, ...], argnums: int, batch_argnums: tuple[int, ...]) -> int:
    """Floating-point numbers in the non-batched arguments besides the differentiated one."""
    import torch
    from torch.utils._pytree import tree_leaves

    return sum(
        x.numel()
        for i, arg in enumerate(args)
        if i != argnums and i not in batch_argnums
        for x in tree_leaves(arg)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    )


def model_numel(
    model: torch.nn.Module | None, args: tuple[Any, ...], argnums: int, names: Iterable[str]
) -> int:
    """Floating-point parameters of ``model`` (a ``BatchedLoss``'s) that are neither
    differentiated nor passed as arguments: frozen weights count however they reach the loss
    (argument or closure), once."""
    if model is None:
        return 0
    from torch.utils._pytree import tree_leaves

    seen = {id(x) for i, a in enumerate(args) if i != argnums for x in tree_leaves(a)}
    own = set(names)
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if name not in own and id(p) not in seen and p.is_floating_point()
    )


def _typed(err: RuntimeError) -> RuntimeError:
    """``err`` itself, or an :class:`OperationError` saying how to fix what torch refused."""
    text = str(err)
    if "in-place operation" in text and "captured Tensor" in text:
        return OperationError(
            "the per-example loss updates a tensor it does not own in place (typically "
            "BatchNorm's running statistics in train mode, or a buffer a layer updates in its "
            "forward), which torch.func's per-example gradients cannot run; batch statistics "
            "also mix the examples, so one example's clipped gradient would not bound its "
            "influence. Put such layers in eval mode (model.eval() keeps dropout off too; "
            "re-enable it per module), or replace BatchNorm with GroupNorm or LayerNorm. "
            f"torch said: {text.splitlines()[0]}"
        )
    if "random operation" in text and "randomness" in text:
        return OperationError(
            "the per-example loss draws random numbers (dropout, a MoE router's jitter, ... in "
            "train mode) while per-example gradients run with randomness='error'; pass "
            "randomness='different' (each example its own draw, what DP-SGD with dropout "
            "means) or put the model in eval mode. "
            f"torch said: {text.splitlines()[0]}"
        )
    return err


def checked_loss(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """Split ``loss_fn``'s output into ``(loss, aux)`` and check the loss is one scalar."""
    import torch

    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ConfigurationError(
                f"loss_fn returned a {type(out).__name__}; with has_aux=True it must "
                "return a pair (loss, aux)"
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
        raise ConfigurationError(
            f"loss_fn returned {shape} for one example; expected a scalar loss tensor "
            "(loss_fn sees a single example without batch dimension; reduce over tokens "
            "inside it, and return model(...).loss rather than the output object)"
        )
    if not loss.is_floating_point():
        raise ConfigurationError(f"loss_fn returned a {loss.dtype} loss; expected float")
    return loss, aux


class VmapEngine:
    """The vmap engine for one ``grad_fn`` call (a :class:`~._chunks.ChunkEngine`).

    ``loss_fn`` takes the differentiated leaves as a dict at ``argnums``. ``expanded``: take the
    expanded-forward path (see the module docstring); if it fails, :attr:`expand_error` says
    why and the vjp path runs from then on.
    """

    name = "vmap"

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        argnums: int,
        batch_argnums: tuple[int, ...],
        has_aux: bool,
        randomness: str,
        names: tuple[str, ...],
        differentiable: bool,
        expanded: bool,
    ) -> None:
        import torch

        self.loss_fn = loss_fn
        self.argnums = argnums
        self.batch_argnums = batch_argnums
        self.has_aux = has_aux
        self.randomness = randomness
        self.names = names
        self.differentiable = differentiable
        self.expanded = expanded
        self.expand_error: str | None = None
        self._vmapped: Callable[..., Any] | None = None
        self._torch = torch

    # ------------------------------------------------------------------ per-example gradients
    def per_example_fn(self) -> Callable[..., Any]:
        """``(*args) -> (grads, loss[, aux])`` for one example, by ``torch.func.vjp``."""
        import torch

        argnums, has_aux, loss_fn = self.argnums, self.has_aux, self.loss_fn

        def per_example(*args: Any) -> tuple[object, ...]:
            def f(diff: dict[str, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, object]:
                call = list(args)
                call[argnums] = diff
                loss, aux = checked_loss(loss_fn(*call), has_aux)
                return (loss, aux) if has_aux else loss

            out: Any = torch.func.vjp(f, args[argnums], has_aux=has_aux)
            loss, vjp_fn = out[0], out[1]
            (grads,) = vjp_fn(torch.ones_like(loss))
            if has_aux:
                return grads, loss, out[2]
            return grads, loss

        return per_example

    def _expanded_per_example(self, args: tuple[Any, ...], m: int) -> _PerExample:
        """Per-example gradients from a vmapped forward over expanded parameters."""
        import torch
        from torch.utils._pytree import tree_map

        leaves = {
            name: value.detach().unsqueeze(0).expand(m, *value.shape).requires_grad_(True)
            for name, value in args[self.argnums].items()
        }
        call = list(args)
        call[self.argnums] = leaves
        in_dims = tuple(
            0 if i == self.argnums or i in self.batch_argnums else None for i in range(len(args))
        )
        loss_fn, has_aux = self.loss_fn, self.has_aux

        def one(*example: Any) -> torch.Tensor | tuple[torch.Tensor, object]:
            loss, aux = checked_loss(loss_fn(*example), has_aux)
            return (loss, aux) if has_aux else loss

        with torch.enable_grad():
            out = torch.func.vmap(one, in_dims=in_dims, randomness=self.randomness)(*call)
            loss, aux = out if isinstance(out, tuple) else (out, None)  # a pair: has_aux
            grads = torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)
        per_example = {
            name: torch.zeros_like(leaf) if grad is None else grad
            for (name, leaf), grad in zip(leaves.items(), grads, strict=True)
        }
        detached = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        return per_example, loss.detach(), detached

    def chunk(self, args: tuple[Any, ...], m: int, units: RowUnits | None = None) -> ChunkOut:
        """Per-example gradients of the chunk and their per-leaf squared norms.

        With ``units``, each unit's rows' gradients are summed (fp32; fp64 kept) and the norms
        are those of the summed tensors: the very tensors :meth:`accumulate` adds.
        """
        torch = self._torch
        out: _PerExample | None = None
        if self.expanded:
            try:
                out = self._expanded_per_example(args, m)
            except (RuntimeError, NotImplementedError) as err:  # e.g. no batching rule
                self.expand_error = f"{type(err).__name__}: {err}"
                self.expanded = False
        if out is None:
            if self._vmapped is None:
                in_dims = tuple(0 if i in self.batch_argnums else None for i in range(len(args)))
                self._vmapped = torch.func.vmap(
                    self.per_example_fn(), in_dims=in_dims, randomness=self.randomness
                )
            try:
                stacked = self._vmapped(*args)  # (grads, loss[, aux]) of every example
            except RuntimeError as err:
                typed = _typed(err)
                if typed is err:
                    raise
                raise typed from err
            out = (stacked[0], stacked[1], stacked[2] if self.has_aux else None)
        grads, loss, aux = out
        if units is not None and not units.identity:
            grads = {n: units.sum_rows(grads[n]) for n in self.names}
            m = units.count
        # certified per-leaf norms of the very tensors that are summed (fp32 blocks summed in
        # fp64: no length of leaf can hide mass from them), and what scaling them by a factor,
        # then dividing by normalize_by, can add (see opake.dpsgd.certify)
        computed, bounds, slack = [], [], []
        summed = dict(grads)  # eagerly the same tensors; compiled, the measured buffers
        with precision(loss.device):
            for n in self.names:
                flat = grads[n].reshape(m, -1)
                hat, up, measured = sq_norms(flat)
                if measured is not flat:
                    summed[n] = measured
                computed.append(hat)
                bounds.append(up * FINAL**2)
                slack.append(torch.full_like(hat, 3.0 * ETA * math.sqrt(flat.shape[1])))
        leaf_sq = torch.stack(computed, dim=1)
        return ChunkOut(
            loss=loss,
            leaf_sq=leaf_sq,
            bound_sq=torch.stack(bounds, dim=1),
            aux=aux,
            payload=summed,
            slack=torch.stack(slack, dim=1),
        )

    # ------------------------------------------------------------------ the weighted sum
    def accumulate(
        self, out: ChunkOut, factors: ClipFactors, sums: dict[str, torch.Tensor]
    ) -> None:
        """Add ``Σ_i factor[i, j] · nan_to_num(g_ij)`` to each leaf's fp32 sum."""
        with precision(factors.leaf_factor.device):  # no enclosing autocast: sums in fp32
            self._accumulate(out.payload, factors.leaf_factor, sums)

    def _accumulate(
        self, grads: Any, leaf_factor: torch.Tensor, sums: dict[str, torch.Tensor]
    ) -> None:
        torch = self._torch
        names = self.names
        if compiling():  # products and sums, no matrix product (see ._compiled)
            for j, name in enumerate(names):
                g = grads[name].reshape(leaf_factor.shape[0], -1)
                wide = torch.float64 if g.dtype == torch.float64 else torch.float32
                g = g.to(wide).nan_to_num(0.0, 0.0, 0.0)
                contrib = (leaf_factor[:, j, None].to(wide) * g).sum(dim=0).to(torch.float32)
                sums[name] = sums[name] + contrib.reshape(sums[name].shape)
            return
        if not self.differentiable and names and kernel_runs_on(leaf_factor.device):
            # fused multi-tensor scale-and-sum: one launch for every leaf
            clip_accumulate([grads[n] for n in names], leaf_factor, [sums[n] for n in names])
            return
        m = leaf_factor.shape[0]
        for j, name in enumerate(names):
            # fp64 gradients are scaled in fp64 and rounded to fp32 once, after the factor: a
            # conversion first would let the factor (> 1 for AUTO-S) multiply its absolute
            # error in fp32's subnormal range, or meet an infinity (proof, section 2)
            raw = grads[name].reshape(m, -1)
            wide = torch.float64 if raw.dtype == torch.float64 else torch.float32
            g = raw.to(wide)
            # a non-finite example has factor 0, but 0·NaN = NaN: zero its entries first
            # (in place when that is safe: a contiguous tensor this call owns)
            if self.differentiable or not g.is_contiguous():
                g = g.nan_to_num(0.0, 0.0, 0.0)
            else:
                g.nan_to_num_(0.0, 0.0, 0.0)
            contrib = (leaf_factor[:, j].to(wide) @ g).to(torch.float32).reshape(sums[name].shape)
            if self.differentiable:
                sums[name] = sums[name] + contrib
            else:
                sums[name].add_(contrib)
