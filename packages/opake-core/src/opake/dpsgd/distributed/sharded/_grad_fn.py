"""``sharded_clipped_grad``: clipped sums through a ``fully_shard``-ed module, unit by unit.

The call runs ``clipped_grad``'s own loop (:class:`~opake.dpsgd.clipping._grad_fn.ClippedGradFn`:
chunks, clip factors from certified bounds, fp32 sums, padding masks) with one engine, the
book-keeping engine over :class:`~._runner.ShardedRunner`: the loss runs the sharded module,
FSDP gathers one unit at a time, the hooks record each layer's inputs ``a_i`` and output
gradients ``δ_i``, the norms come from those records, and each layer's clipped sum
``Σ_i c_i a_iᵀ δ_i`` is formed from them once the norms are known — no weight is read.

The engine's own check against per-example autograd does not run here: it would run one
example through the sharded module on some ranks only (unmatched collectives) and let FSDP
reduce-scatter that rank's gradient alone. Level 2 runs its own cross-rank check instead
(:mod:`._check`): on the first chunk and every ``RECHECK_EVERY`` chunks, secret rows of every
rank again, each alone, through the same runner (a row whose norms depend on the other rows —
something mixes examples — refuses the call on every rank), then one secretly chosen example
against plain autograd through the sharded module, every rank running the same collectives
(:mod:`._autograd`: a parameter read outside its layer refuses the call on every rank). Each
example's contribution is bounded by certified norms of the very pieces that are summed; the
rules are validated against per-example autograd by the conformance harness.

``grad_fn(..., reduce_scatter=True)`` (a logical step of one physical batch): in the call's last
chunk each parameter's sum is complete once the engine moves on to the next parameter (it forms
them one at a time, :class:`~opake.dpsgd.bookkeeping._chunk.BookkeepingChunk`), so it is
reduce-scattered then (SUM, fp32, :func:`~opake.dpsgd.distributed._rows.reduce_rows`) and its
full-size memory released before the next one is formed: with one chunk per call, at most one
full-size sum is alive on a rank. The call returns this rank's rows of the global sum
(:class:`~opake.dpsgd.distributed._rows.ScatteredGrads`); the optimizer does not reduce again.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OpakePrivacyWarning,
    OperationError,
)
from opake.dpsgd.clipping._bookkeeping import BookkeepingEngine
from opake.dpsgd.clipping._compiled import compiling, refuse
from opake.dpsgd.clipping._grad_fn import ClippedGradFn
from opake.dpsgd.clipping._grads import ClippedGrads
from opake.dpsgd.distributed._replicas import _comm_device
from opake.dpsgd.distributed._rows import ScatteredGrads, _local, reduce_rows
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
    from opake.dpsgd.clipping._base import ClipFactors, ClipState
    from opake.dpsgd.clipping._call import Call
    from opake.dpsgd.clipping._chunks import ChunkEngine, ChunkOut
    from opake.dpsgd.clipping._grads import ClipAux
    from opake.dpsgd.clipping._tree import DiffTree

__all__ = ["ShardedClippedGradFn"]

#: FSDP warns when a unit returns a view: here the book-keeping tap (an identity view) of the
#: unit's last hooked layer; the loss never writes into it in place
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"

_log = logging.getLogger("opake.core")


class _Scatter:
    """One ``reduce_scatter=True`` call's reductions: each parameter's sum to this rank's rows,
    once (``done``: the names reduced so far, in the same order on every rank)."""

    def __init__(self, params: Mapping[str, torch.Tensor], group: Any) -> None:
        self.params = params
        self.group = group
        self.device = _comm_device(group)
        self.done: set[str] = set()

    def reduce(self, name: str, full: torch.Tensor, *, release: bool = False) -> torch.Tensor:
        """This rank's rows of the SUM over the ranks of ``full`` (a collective). ``release``:
        free ``full``'s memory now — the engine's loop still names it until its next leaf."""
        if name in self.done:
            raise _read_again(name)
        rows = reduce_rows(full, self.params[name], group=self.group, device=self.device)
        self.done.add(name)
        storage = full.untyped_storage()
        if release and _local(rows).untyped_storage().data_ptr() != storage.data_ptr():
            storage.resize_(0)
        return rows


def _read_again(name: str) -> OperationError:
    return OperationError(
        f"sharded grad_fn(reduce_scatter=True): the sum of {name!r} was read again after it was "
        "reduce-scattered; the engine must form each sum once (please report it)"
    )


class _ScatteringSums(Mapping[str, "torch.Tensor"]):
    """The running sums during a call's last chunk: the engine forms them one leaf at a time,
    so a leaf's sum is complete when the next one is looked up (or when :meth:`flush` runs
    after the chunk); it is then reduce-scattered and replaced by this rank's rows."""

    def __init__(self, sums: dict[str, torch.Tensor], scatter: _Scatter) -> None:
        self._sums = sums
        self._scatter = scatter
        self._open: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name != self._open:
            self.flush()
            if name in self._scatter.done:
                raise _read_again(name)
            self._open = name
        return self._sums[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums)

    def __len__(self) -> int:
        return len(self._sums)

    def flush(self) -> None:
        """Reduce-scatter the leaf being formed, if any (its sum is complete)."""
        name, self._open = self._open, None
        if name is not None:
            self._sums[name] = self._scatter.reduce(name, self._sums[name], release=True)


class _Engine(ClippedGradFn):
    """``clipped_grad``'s loop with the sharded runner, always, and no vmap fallback;
    ``scatter``: the reductions of a ``reduce_scatter=True`` call (set for the call only)."""

    scatter: _Scatter | None = None

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
            engine.rows = call.batch
            # the division by normalize_by comes after the loop: then the sums are reduced
            # after it, at the end of the call (as the optimizer's step would)
            engine.scatter = self.scatter if self.normalize_by == 1.0 else None
        return super()._run(engine, call)


class _CheckedEngine(BookkeepingEngine):
    """The book-keeping engine with level 2's per-example check (:mod:`._check`) after each
    chunk, before its sums are formed (chunks are consecutive slices of the call's rows)."""

    mask: torch.Tensor | None = None
    rows = 0  # the call's rows (padding included)
    scatter: _Scatter | None = None
    _start = 0

    def chunk(self, args: tuple[Any, ...], m: int, units: RowUnits | None = None) -> ChunkOut:
        out = super().chunk(args, m, units)
        start, self._start = self._start, self._start + m
        is_real = None if self.mask is None else self.mask[start : start + m]
        runner = self.runner
        assert isinstance(runner, ShardedRunner)
        runner.row_check(runner, args, out.payload, is_real)
        return out

    def accumulate(
        self, out: ChunkOut, factors: ClipFactors, sums: dict[str, torch.Tensor]
    ) -> None:
        """The chunk's weighted sum; in a ``reduce_scatter=True`` call's last chunk, each
        leaf's completed sum is reduce-scattered before the next one is formed."""
        if self.scatter is None or self._start < self.rows:
            super().accumulate(out, factors, sums)
            return
        view = _ScatteringSums(sums, self.scatter)
        # a read-only Mapping, not the declared dict: the engine only looks sums up (adds in place)
        super().accumulate(out, factors, view)  # type: ignore[arg-type]
        view.flush()


def _scattered(grads: ClippedGrads, scatter: _Scatter) -> ScatteredGrads:
    """``grads`` as this rank's rows: the sums the engine did not reduce (no chunk ran, or
    ``normalize_by`` ≠ 1) are reduce-scattered here, one at a time, in the leaves' order."""
    for name in list(grads):
        if name not in scatter.done:
            grads[name] = scatter.reduce(name, grads[name])
    out = ScatteredGrads(grads, max_norm=grads.max_norm, batch_size=grads.batch_size)
    out.count_noise_multiplier = grads.count_noise_multiplier
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
    every later call; ranks whose calls do not line up raise ``ConfigurationError``, and a
    rank that calls ``ShardedDPOptimizer.step()`` while another calls ``grad_fn`` once more
    makes both raise ``OperationError`` (never a hang).

    ``reduce_scatter=True`` (every rank alike) declares the call its logical step's only
    physical batch (its first call, ``end_step=True``): each parameter's clipped sum is
    reduce-scattered (SUM, fp32) as soon as it is formed and its full-size memory released, so
    with one chunk per call (``microbatch_size`` ``None`` or at least the ranks' largest batch)
    at most one full-size sum is alive on the rank; with several chunks every partial sum is
    kept until the last one, and with ``normalize_by`` ≠ 1 the sums are reduced after the
    division, at the end of the call (logged). ``grads`` is then a
    :class:`~opake.dpsgd.distributed._rows.ScatteredGrads`: this rank's rows of the *global*
    sum (``DTensor`` shards), for ``ShardedDPOptimizer.accumulate`` followed by ``step()``,
    bit for bit what the step's own reduce-scatter gives.
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
        self._said_scatter = False

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
        reduce_scatter: bool = False,
        **unknown: Any,
    ) -> tuple[Any, ClipState]:
        """Clipped sums of this rank's batch (see the class); every rank calls it alike."""
        if unknown:
            name = next(iter(unknown))
            raise ConfigurationError(
                f"sharded grad_fn() got an unsupported keyword argument {name!r}; accepted: "
                "state, end_step, example_mask, reduce_scatter (privacy units are not "
                "supported by per-layer sharded compute yet)"
            )
        if not isinstance(reduce_scatter, bool):
            raise InputTypeError(f"reduce_scatter={reduce_scatter!r}: expected True or False")
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
        flags = (int(end_step), self._engine.microbatch_size or 0, int(reduce_scatter))
        call, mask, local = agreed_batch(
            args,
            positions,
            example_mask,
            group=self._group,
            device=device,
            calls=(index, *flags),
            names=zlib.crc32("\n".join(params).encode()),
        )
        if reduce_scatter:  # the ranks agree on index and end_step: all raise alike
            self._check_scatter(index, end_step)
        self._in_step = 0 if end_step else index
        self._engine.scatter = _Scatter(params, self._group) if reduce_scatter else None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
                out, new_state = self._engine(
                    params, *call, state=state, end_step=end_step, example_mask=mask
                )
            scatter, self._engine.scatter = self._engine.scatter, None
        finally:
            self._engine.scatter = None
        if local and not self._warned:
            self._warned = True
            self._warn_unread()
        grads, aux = out if self._engine.return_aux else (out, None)
        if scatter is not None:
            grads = _scattered(grads, scatter)
        if aux is None:
            return grads, new_state
        return (grads, aux if call is args else _trim(aux, local)), new_state

    def new_step(self) -> None:
        """The next call starts a logical step, as after ``end_step=True``: what
        ``DPTraining(shard=True)`` calls when a step ends or is dropped (its calls pass
        ``end_step=False``). Every rank calls it alike."""
        self._in_step = 0

    def _check_scatter(self, index: int, end_step: bool) -> None:
        """``reduce_scatter=True`` is the step's only physical batch: its first and last call."""
        if index != 1 or not end_step:
            raise ConfigurationError(
                "sharded grad_fn(reduce_scatter=True) declares the call its logical step's only "
                f"physical batch, but it is call {index} of its step (end_step={end_step}); pass "
                "it only to a step's first and last call (end_step=True, no end_step=False call "
                "before it in the step), or drop reduce_scatter to accumulate several physical "
                "batches"
            )
        if self._engine.normalize_by != 1.0 and not self._said_scatter:
            self._said_scatter = True
            _log.info(
                "sharded grad_fn(reduce_scatter=True) with normalize_by=%g: each parameter's "
                "sum is reduce-scattered after the call's division, all of them formed first",
                self._engine.normalize_by,
            )

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
