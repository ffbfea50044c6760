"""``sharded_clipped_grad``: clipped sums through a ``fully_shard``-ed module, unit by unit.

The call runs ``clipped_grad``'s own loop (:class:`~opake.dpsgd.clipping._grad_fn.ClippedGradFn`:
chunks, clip factors from certified bounds, fp32 sums, padding masks) with one engine, the
book-keeping engine over :class:`~._runner.ShardedRunner`: the loss runs the sharded module,
FSDP gathers one unit at a time, the hooks record each layer's inputs ``a_i`` and output
gradients ``δ_i``, the norms come from those records, and each layer's clipped sum
``Σ_i c_i a_iᵀ δ_i`` is formed from them once the norms are known — no weight is read.

The engine's check against per-example autograd does not run here: it would run one example
through the sharded module on some ranks only (unmatched collectives) and differentiate FSDP's
parameters (FSDP would then reduce-scatter their gradients itself). Level 2 runs its own
cross-rank check instead (:mod:`._check`): on the first chunk and every ``RECHECK_EVERY``
chunks, one secret row per rank again, alone, through the same runner; a row whose norms
depend on the other rows (something mixes examples) refuses the call on every rank. Each
example's contribution is bounded by certified norms of the very pieces that are summed; the
rules are validated against per-example autograd by the conformance harness.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OpakePrivacyWarning, OperationError
from opake.dpsgd.clipping._bookkeeping import BookkeepingEngine
from opake.dpsgd.clipping._compiled import compiling, refuse
from opake.dpsgd.clipping._grad_fn import ClippedGradFn
from opake.dpsgd.distributed.sharded._batch import agreed_batch
from opake.dpsgd.distributed.sharded._plan import (
    refuse_batch_statistics,
    sharded_plan,
    trainable,
)
from opake.dpsgd.distributed.sharded._runner import ShardedRunner

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._plan import BookkeepingPlan
    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner
    from opake.dpsgd.bookkeeping._units import RowUnits
    from opake.dpsgd.clipping._base import ClipState
    from opake.dpsgd.clipping._call import Call
    from opake.dpsgd.clipping._chunks import ChunkEngine, ChunkOut
    from opake.dpsgd.clipping._grads import ClipAux
    from opake.dpsgd.clipping._tree import DiffTree

__all__ = ["ShardedClippedGradFn"]

#: FSDP warns when a unit returns a view: here the book-keeping tap (an identity view) of the
#: unit's last hooked layer; the loss never writes into it in place
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


class _Engine(ClippedGradFn):
    """``clipped_grad``'s loop with the sharded runner, always, and no vmap fallback."""

    def _prefer_expanded(self, args: tuple[Any, ...], differentiable: bool) -> bool:
        return False

    def _choose(
        self, tree: DiffTree, small: bool, differentiable: bool, units: bool = False
    ) -> BookkeepingRunner | None:
        if compiling():
            raise refuse("sharded_clipped_grad", "FSDP's hooks and the engine's taps are eager")
        if differentiable:
            raise ConfigurationError(
                "sharded_clipped_grad: grad_fn ran under an outer torch.func transform; the "
                "sharded engine runs FSDP's eager hooks and cannot be differentiated through"
            )
        self._report("bookkeeping", "sharded book-keeping (FSDP gathers one unit at a time)")
        return self._bookkeeping

    def _engine(
        self, runner: BookkeepingRunner | None, tree: DiffTree, *, differentiable: bool, small: bool
    ) -> ChunkEngine:
        if runner is None:  # fail closed: vmap through FSDP's module is silently wrong
            raise OperationError(
                "sharded_clipped_grad never falls back to the vmap engine (through a "
                "fully_shard-ed module its per-example gradients are silently wrong); "
                "the book-keeping engine could not run this call"
            )
        loss_fn = tree.wrap(self.loss_fn, self.argnums)
        return _CheckedEngine(runner, loss_fn, names=tree.names, check=False)

    def _run(
        self, engine: ChunkEngine, call: Call
    ) -> tuple[dict[str, torch.Tensor], ClipAux, torch.Tensor]:
        if isinstance(engine, _CheckedEngine):
            engine.mask = call.mask  # the padding rows the check must not draw
        return super()._run(engine, call)


class _CheckedEngine(BookkeepingEngine):
    """The book-keeping engine with level 2's per-example check (:mod:`._check`) after each
    chunk, before its sums are formed (chunks are consecutive slices of the call's rows)."""

    mask: torch.Tensor | None = None
    _start = 0

    def chunk(self, args: tuple[Any, ...], m: int, units: RowUnits | None = None) -> ChunkOut:
        out = super().chunk(args, m, units)
        start, self._start = self._start, self._start + m
        is_real = None if self.mask is None else self.mask[start : start + m]
        runner = self.runner
        assert isinstance(runner, ShardedRunner)
        runner.row_check(runner, args, out.payload, is_real)
        return out


def _trim(aux: ClipAux, rows: int) -> ClipAux:
    """``aux`` without the padding rows :mod:`._batch` appended (the first ``rows`` stay)."""
    import torch
    from torch.utils._pytree import tree_map

    def head(x: object) -> object:
        return x[:rows] if isinstance(x, torch.Tensor) and x.dim() else x

    groups = aux.group_grad_norms
    return dataclasses.replace(
        aux,
        loss_values=aux.loss_values[:rows],
        grad_norms=aux.grad_norms[:rows],
        clipped_grad_norms=aux.clipped_grad_norms[:rows],
        loss_aux=tree_map(head, aux.loss_aux),
        group_grad_norms=None if groups is None else {k: v[:rows] for k, v in groups.items()},
    )


class ShardedClippedGradFn:
    """The ``grad_fn`` of :func:`~opake.dpsgd.distributed.sharded_clipped_grad`.

    ``grad_fn(*batch, state=state)`` → ``(grads, new_state)`` (``((grads, aux), new_state)``
    with ``return_aux``): ``grads`` is a :class:`~opake.dpsgd.clipping.ClippedGrads` of
    **full-size** fp32 clipped sums of this rank's examples, keyed by the module's trainable
    parameter names, for :meth:`ShardedDPOptimizer.accumulate
    <opake.dpsgd.distributed.ShardedDPOptimizer.accumulate>`. Every rank calls it the same
    number of times per logical step (an empty shard included): each call agrees on the
    largest local batch and pads to it (:mod:`._batch`). ``example_mask`` marks padding rows
    as in ``clipped_grad``; ``units=`` is not supported here. With ``return_aux`` the
    per-example figures are this rank's rows only (not private, as in ``clipped_grad``).
    The per-example check (:mod:`._check`) runs on the first chunk and every
    ``RECHECK_EVERY`` chunks: a mismatch raises
    :class:`~opake.dpsgd.bookkeeping._check.BookkeepingMismatchError` on every rank, then at
    every later call; ranks whose calls do not line up raise ``ConfigurationError``.
    """

    def __init__(
        self, engine: _Engine, module: torch.nn.Module, group: Any, trusted: frozenset[str]
    ) -> None:
        self._engine = engine
        self.module = module
        self._group = group
        self._trusted = trusted
        self._plan: BookkeepingPlan | None = None
        self._names: tuple[str, ...] = ()
        self._warned = False
        self._in_step = 0  # calls since the last end_step=True

    @property
    def engine(self) -> str | None:
        """``"bookkeeping"`` after a call (``None`` before)."""
        return self._engine.engine

    def plan(self) -> BookkeepingPlan:
        """The (checked, cached) book-keeping plan of the module's trainable parameters."""
        names = tuple(trainable(self.module))
        if self._plan is None or names != self._names:
            self._plan = sharded_plan(self.module, names, trusted=self._trusted)
            self._names = names
        return self._plan

    def __call__(
        self,
        *args: Any,
        state: ClipState,
        end_step: bool = True,
        example_mask: torch.Tensor | None = None,
        **unknown: Any,
    ) -> tuple[Any, ClipState]:
        """Clipped sums of this rank's batch (see the class); every rank calls it alike."""
        if unknown:
            name = next(iter(unknown))
            raise ConfigurationError(
                f"sharded grad_fn() got an unsupported keyword argument {name!r}; accepted: "
                "state, end_step, example_mask (privacy units are not supported by per-layer "
                "sharded compute yet)"
            )
        # before any collective, on every rank alike: a failed check refuses every later call;
        # no layer without a closed-form rule; no batch statistics (the mode can change)
        runner = self._engine._bookkeeping
        assert isinstance(runner, ShardedRunner)
        runner.row_check.refuse_if_failed()
        self.plan()
        refuse_batch_statistics(self.module)
        params = trainable(self.module)
        device = next(iter(params.values())).device
        positions = tuple(p - 1 for p in self._engine.batch_argnums)
        index = self._in_step + 1  # this call's place in its logical step
        call, mask, local = agreed_batch(
            args,
            positions,
            example_mask,
            group=self._group,
            device=device,
            calls=(index, int(end_step), self._engine.microbatch_size or 0),
        )
        self._in_step = 0 if end_step else index
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
            out, new_state = self._engine(
                params, *call, state=state, end_step=end_step, example_mask=mask
            )
        if local and not self._warned:
            self._warned = True
            self._warn_unread()
        if self._engine.return_aux and call is not args:  # drop the padding rows we added
            grads, aux = out
            out = (grads, _trim(aux, local))
        return out, new_state

    def _warn_unread(self) -> None:
        """Warn once about trainable parameters no recorded layer read (trained on noise)."""
        runner = self._engine._bookkeeping
        assert runner is not None
        assert self._plan is not None
        ran = set(runner._layout)
        unread = [
            n for layer in self._plan.layers if layer.module not in ran for _, n in layer.params
        ]
        if unread:
            warnings.warn(
                f"sharded_clipped_grad: the loss does not read trainable parameter(s) "
                f"{unread[:10]}; they receive no gradient and would be trained on noise alone. "
                "Freeze them (requires_grad_(False)) before building the optimizer.",
                OpakePrivacyWarning,
                stacklevel=3,
            )
