"""``grad_fn``: per call, pick the engine, then chunk → factors → accumulate.

The clip state computes the factors (:mod:`._base`), the engine the norms and the weighted sum
(:mod:`._chunks`), the call's checks and chunks are :mod:`._call`; this module picks the
engine (logged on ``opake.core``) and runs the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OpakePrivacyWarning
from opake.dpsgd.bookkeeping._check import BookkeepingInconclusiveError, BookkeepingMismatchError
from opake.dpsgd.bookkeeping._runner import BookkeepingRunner
from opake.dpsgd.bookkeeping._units import UnitsUnsupportedError
from opake.dpsgd.certify import adjust_factors, division_slack, divisor_up
from opake.dpsgd.clipping import _vmap_engine as vmap_engine
from opake.dpsgd.clipping._base import ChunkNorms, ClipState, GroupSpec
from opake.dpsgd.clipping._bookkeeping import BookkeepingEngine
from opake.dpsgd.clipping._call import (
    Call,
    batch_size,
    cast_floats,
    check_args,
    check_mask,
    check_state,
    chunks,
)
from opake.dpsgd.clipping._choice import choose as choose_engine
from opake.dpsgd.clipping._chunks import (
    CallRecord,
    ChunkEngine,
    ChunkOut,
    LazySums,
    outer_transform_differentiates,
)
from opake.dpsgd.clipping._compiled import compiling, precision, refuse, register
from opake.dpsgd.clipping._grads import ClipAux, ClippedGrads
from opake.dpsgd.clipping._tree import DiffTree
from opake.dpsgd.clipping._units import UnitCall, check_units

if TYPE_CHECKING:
    import torch

__all__ = ["ClippedGradFn"]

_log = logging.getLogger("opake.core")

#: one engine's run of a call: the sums by leaf name, the call's aux, the count the state
#: advances by (adaptive clipping), the engine's name
_Run = tuple[dict[str, "torch.Tensor"], ClipAux, "torch.Tensor", str]


class ClippedGradFn:
    """The ``grad_fn`` returned by :func:`clipped_grad` (see there for the semantics).

    ``grad_fn(*args, state=state)`` → ``(grads, new_state)``, or ``((grads, aux), new_state)``
    when built with ``return_aux=True``. Keyword-only extras:

    - ``end_step`` (default ``True``): close the logical step (adaptive clipping updates C).
      Pass ``False`` for every physical batch but the last when accumulating gradients.
    - ``example_mask``: optional ``[B]`` bool tensor; ``False`` rows (padding of a fixed-shape
      batch) contribute exactly zero and are not counted anywhere.
    - ``units``: optional ``[B]`` integer tensor, each row's privacy unit (equal ids form a
      unit, its rows anywhere in the batch). Each unit's gradient — the sum of its real rows'
      gradients — is clipped as a whole, on either engine, under the same proof: the result
      is ``Σ_u clip(Σ_{i∈u} g_i)``, ``max_norm`` unchanged (C per unit). ``ClipAux`` norms
      are per unit (see ``unit_ids``); adaptive clipping counts units. Chunks hold whole
      units (a unit larger than ``microbatch_size`` gets its own). Never split a unit across
      calls that are summed (physical batches of a step, ranks). ``None``: one row, one unit.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        argnums: int,
        has_aux: bool,
        batch_argnums: tuple[int, ...],
        microbatch_size: int | None,
        normalize_by: float,
        return_aux: bool,
        compute_dtype: torch.dtype | None,
        clipping_groups: GroupSpec,
        randomness: str,
        kind: type,
        check_unused: bool,
        requested_engine: str = "vmap",
        bookkeeping: BookkeepingRunner | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        #: the engine asked for (``clipped_grad(engine=...)``): "auto", "vmap" or "bookkeeping"
        self.requested_engine = requested_engine
        self._bookkeeping = bookkeeping
        self._model = model  # a BatchedLoss's model: what "auto" decides from
        #: engine of the last call ("vmap" or "bookkeeping") and why it was chosen
        self.engine: str | None = None
        self.engine_reason: str | None = None
        self.argnums = argnums
        self.has_aux = has_aux
        self.batch_argnums = batch_argnums
        self.microbatch_size = microbatch_size
        self.normalize_by = normalize_by
        self.return_aux = return_aux
        self.compute_dtype = compute_dtype
        self.clipping_groups = clipping_groups
        self.randomness = randomness
        self._kind = kind
        self._check_unused = check_unused
        self._group_cache: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[int, ...]] = {}
        #: why the expanded-forward path is off for good (None: chosen per call by size)
        self._expand_disabled: str | None = None
        self._logged: tuple[str, str] | None = None
        self._fraction_cache: dict[tuple[tuple[str, tuple[int, ...]], ...], int] = {}
        #: ``normalize_by`` as fp32 rounded up, a Python float (exact in fp32): no host sync
        #: in the call, so a compiled call traces it as a constant
        self._divisor = float(divisor_up(normalize_by, _cpu())) if normalize_by != 1.0 else 1.0
        register()  # the operator a compiled call measures norms with (see ._compiled)

    def __repr__(self) -> str:
        return (
            f"ClippedGradFn({getattr(self.loss_fn, '__name__', self.loss_fn)!r}, "
            f"clipping={self._kind.__name__}, argnums={self.argnums}, "
            f"batch_argnums={self.batch_argnums}, microbatch_size={self.microbatch_size})"
        )

    # ------------------------------------------------------------------ group lookup
    def _groups(self, names: tuple[str, ...], state: ClipState) -> tuple[int, ...] | None:
        key = (names, state.group_names() or ())
        if key not in self._group_cache:
            groups = state.leaf_groups(names, self.clipping_groups)
            if groups is None:
                return None
            self._group_cache[key] = groups
        return self._group_cache[key]

    # ------------------------------------------------------------------ engines
    def _prefer_expanded(self, args: tuple[Any, ...], differentiable: bool) -> bool:
        """Is the differentiated part small (LoRA)? Decided from the arguments and, for a
        ``BatchedLoss``, its model (frozen weights count however they reach the loss)."""
        if differentiable or self._expand_disabled is not None:
            return False
        tree = DiffTree.of(args[self.argnums], argnums=self.argnums)
        key = tuple((n, tuple(v.shape)) for n, v in tree.leaves.items())
        if key not in self._fraction_cache:  # the model's share is fixed per parameter set
            own = vmap_engine.model_numel(self._model, args, self.argnums, tree.names)
            self._fraction_cache[key] = own
        other = self._fraction_cache[key] + vmap_engine.argument_numel(
            args, self.argnums, self.batch_argnums
        )
        diff = sum(v.numel() for v in tree.leaves.values())
        return vmap_engine.small_fraction(diff, other)

    def compiled_engine(self, args: tuple[Any, ...]) -> str:
        """The engine a compiled step runs (``DPTraining(compile=True)``) for calls like
        ``grad_fn(*args)``: ``"bookkeeping"`` (its batched forward and backward compiled) where
        an eager call would run book-keeping on differentiated parameters that are not a small
        part of the model, else ``"vmap"`` (the call compiled whole: faster for adapters)."""
        if self._bookkeeping is None or self.requested_engine == "vmap":
            return "vmap"
        if self.requested_engine == "bookkeeping":
            return "bookkeeping"
        tree = DiffTree.of(args[self.argnums], argnums=self.argnums)
        if not tree.plain or self._prefer_expanded(args, False):
            return "vmap"
        runner, _ = choose_engine(
            self._bookkeeping, "auto", tree.names, differentiable=False, randomness=self.randomness
        )
        return "vmap" if runner is None else "bookkeeping"

    def _choose(
        self, tree: DiffTree, small: bool, differentiable: bool, units: bool = False
    ) -> BookkeepingRunner | None:
        """The book-keeping runner for this call, or ``None`` for the vmap engine (logged)."""
        if compiling():  # the vmap engine only (see ._compiled), nothing logged
            if self.requested_engine == "bookkeeping":
                raise refuse(
                    "engine='bookkeeping'",
                    "its taps are forward/backward hooks recording into a ContextVar, with "
                    "host-side checks; use engine='vmap' or 'auto' (vmap when compiled), or "
                    "DPTraining(compile=True), which compiles book-keeping's forward and backward",
                )
            return None
        if self._bookkeeping is not None and not tree.plain:
            if self.requested_engine == "bookkeeping":
                raise ConfigurationError(
                    "clipped_grad(engine='bookkeeping') needs the differentiated argument as a "
                    "flat dict parameter name → tensor (the model's names); use engine='vmap' "
                    "for other structures"
                )
            runner, reason = None, "the differentiated argument is not a flat dict of tensors"
        else:
            # A BatchedLoss: book-keeping wherever it applies, adapters included. On the
            # DP-step benchmark (LoRA r=8, loss-only head) it took less CPU time than the vmap
            # engine's expanded forward over the same loss, so the size of the differentiated
            # part no longer matters, nor how the frozen weights reach the loss.
            runner, reason = choose_engine(
                self._bookkeeping,
                self.requested_engine,
                tree.names,
                differentiable=differentiable,
                randomness=self.randomness,
                units=units,
            )
            if runner is not None and small:
                reason += (
                    "; the differentiated parameters are a small part of the model (e.g. LoRA), "
                    "where book-keeping is also the faster engine"
                )
        self._report("vmap" if runner is None else "bookkeeping", reason)
        return runner

    def _report(self, engine: str, reason: str) -> None:
        self.engine_reason = reason
        if self.requested_engine == "auto" and self._logged != (engine, reason):
            self._logged = (engine, reason)
            _log.info("clipped_grad(engine='auto'): the %s engine (%s)", engine, reason)

    def _engine(
        self, runner: BookkeepingRunner | None, tree: DiffTree, *, differentiable: bool, small: bool
    ) -> ChunkEngine:
        loss_fn = tree.wrap(self.loss_fn, self.argnums)
        if runner is not None:  # chosen only with randomness="error": the check runs
            return BookkeepingEngine(runner, loss_fn, names=tree.names, check=True)
        return vmap_engine.VmapEngine(
            loss_fn,
            argnums=self.argnums,
            batch_argnums=self.batch_argnums,
            has_aux=self.has_aux,
            randomness=self.randomness,
            names=tree.names,
            differentiable=differentiable,
            expanded=small,
        )

    # ------------------------------------------------------------------ the call
    def __call__(
        self,
        *args: Any,
        state: ClipState,
        end_step: bool = True,
        example_mask: torch.Tensor | None = None,
        units: torch.Tensor | None = None,
    ) -> tuple[Any, ClipState]:
        """Clipped, summed per-example gradients of ``loss_fn`` over the batch arguments.

        Returns ``(grads, new_state)``, or ``((grads, aux), new_state)`` with ``return_aux``:
        ``grads`` has the structure of the differentiated argument (a :class:`ClippedGrads`
        for a flat dict; Any: that structure is the caller's), ``aux`` a :class:`ClipAux`.
        """
        import torch

        check_state(state, self._kind, end_step)
        compiled = compiling()
        if compiled and type(state).advance is not ClipState.advance:
            raise refuse(
                f"{type(state).__name__}",
                "a clip state that changes from step to step is rebuilt in Python",
            )
        tree = check_args(args, self.argnums, self.batch_argnums)
        batch = batch_size(args, self.batch_argnums)
        device = next(iter(tree.leaves.values())).device
        groups = self._groups(tree.names, state)
        mask = check_mask(example_mask, batch, device)
        ids = check_units(units, batch, device)
        if ids is not None and compiled:
            raise refuse("units=", "cutting whole privacy units into chunks is host-side")
        plan = None if ids is None else UnitCall.plan(ids, mask, self.microbatch_size)
        differentiable = False if compiled else outer_transform_differentiates()
        if self.compute_dtype is not None:
            args = cast_floats(args, self.compute_dtype)
            tree = DiffTree.of(args[self.argnums], argnums=self.argnums)
        call = list(args)
        call[self.argnums] = tree.leaves
        args = tuple(call)
        small = not compiled and self._prefer_expanded(args, differentiable)
        runner = self._choose(tree, small, differentiable, plan is not None)
        run = self._runner(
            Call(args, tree, state, batch, groups, mask, differentiable, small, plan)
        )
        with contextlib.nullcontext() if differentiable else torch.no_grad():
            try:
                sums, aux, count, engine = run(runner)
            except BookkeepingMismatchError as err:  # the check failed: "auto" falls back
                if self.requested_engine == "bookkeeping":
                    raise
                _log.warning("clipped_grad: %s; using the vmap engine from now on", err)
                self._report("vmap", str(err))
                sums, aux, count, engine = run(None)
            except UnitsUnsupportedError as err:  # pieces that cannot be summed per unit
                if self.requested_engine == "bookkeeping":
                    raise ConfigurationError(f"clipped_grad(engine='bookkeeping'): {err}") from err
                self._report("vmap", str(err))
                sums, aux, count, engine = run(None)
            except BookkeepingInconclusiveError as err:  # never an unchecked result
                level = logging.WARNING if self.requested_engine == "bookkeeping" else logging.INFO
                _log.log(level, "clipped_grad: %s; this call uses the vmap engine", err)
                self.engine_reason = str(err)
                sums, aux, count, engine = run(None)
        self.engine = engine
        if self._check_unused and batch > 0 and not differentiable and not compiled:
            self._check_unused = False
            self._warn_unused(args, tree)
        new_state = state.advance(count, end_step=end_step)
        out = tree.rebuild(sums)
        if tree.plain:
            out = ClippedGrads(
                out, max_norm=state.sensitivity / self.normalize_by, batch_size=aux.batch_size
            )
            # adaptive clipping also released a noisy count: the optimizer must account for it
            out.count_noise_multiplier = state.count_noise_multiplier
        if self.return_aux:
            return (out, aux), new_state
        return out, new_state

    def _runner(self, call: Call) -> Callable[[BookkeepingRunner | None], _Run]:
        def run(runner: BookkeepingRunner | None) -> _Run:
            engine = self._engine(
                runner, call.tree, differentiable=call.differentiable, small=call.small
            )
            try:
                sums, aux, count = self._run(engine, call)
            finally:
                error = getattr(engine, "expand_error", None)
                if error is not None and self._expand_disabled is None:
                    self._expand_disabled = error
                    _log.info(
                        "clipped_grad: the vmap engine's expanded forward failed (%s); it "
                        "computes per-example gradients by vjp from now on",
                        error,
                    )
            return sums, aux, count, engine.name

        return run

    def _run(
        self, engine: ChunkEngine, call: Call
    ) -> tuple[dict[str, torch.Tensor], ClipAux, torch.Tensor]:
        """chunk → factors (the clip state) → accumulate (the engine), for every chunk."""
        import torch

        leaves, mask, state = call.tree.leaves, call.mask, call.state
        device = next(iter(leaves.values())).device
        shapes = {n: tuple(v.shape) for n, v in leaves.items()}
        sums: dict[str, torch.Tensor] = LazySums(shapes, device)
        if compiling():  # allocated up front: a traced dict has no __missing__
            sums = {
                n: torch.zeros(s, dtype=torch.float32, device=device) for n, s in shapes.items()
            }
        real = torch.tensor(call.batch, device=device) if mask is None else mask.sum()
        if call.units is not None:
            real = call.units.real_count()
        record = CallRecord(device, real, call.differentiable)
        for chunk_args, m, is_real, units in chunks(
            call, self.microbatch_size, self.batch_argnums, device
        ):
            out = engine.chunk(chunk_args, m, units) if units else engine.chunk(chunk_args, m)
            norms = ChunkNorms(out.leaf_sq, out.bound_sq, is_real, call.groups)
            factors = state.factors(norms)
            slack = self._slack(out, call)
            if slack is not None:  # rounding that does not scale with the factor
                adjusted = adjust_factors(factors.leaf_factor, out.bound_sq, slack)
                factors = dataclasses.replace(factors, leaf_factor=adjusted)
            engine.accumulate(out, factors, sums)
            record.add(out, norms, factors, self.has_aux)
        sums = {name: sums[name] for name in leaves}  # leaf order; a leaf never added: zeros
        if self.normalize_by != 1.0:
            divisor = torch.tensor(self._divisor, dtype=torch.float32, device=device)
            with precision(device):
                sums = {name: value / divisor for name, value in sums.items()}
        aux = record.result(state.group_names())
        if call.units is not None:
            aux = call.units.finish(aux)
        return sums, aux, record.count

    def _slack(self, out: ChunkOut, call: Call) -> torch.Tensor | None:
        """The chunk's slack plus what the final division by ``normalize_by`` can add."""
        if self.normalize_by == 1.0:
            return out.slack
        numel = [v.numel() for v in call.tree.leaves.values()]
        return division_slack(out.slack, out.bound_sq, numel, self.normalize_by)

    def _warn_unused(self, args: tuple[Any, ...], tree: DiffTree) -> None:
        """Warn (once) about differentiated leaves the loss does not depend on at all."""
        import torch
        from torch.utils._pytree import tree_map

        call = list(args)
        for pos in self.batch_argnums:
            call[pos] = tree_map(lambda x: x[0] if isinstance(x, torch.Tensor) else x, args[pos])
        leaves = {name: value.detach().requires_grad_(True) for name, value in tree.leaves.items()}
        call[self.argnums] = leaves
        loss_fn = tree.wrap(self.loss_fn, self.argnums)
        with torch.enable_grad():
            out = loss_fn(*call)
            loss = out[0] if self.has_aux else out
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        unused = [name for name, g in zip(leaves, grads, strict=True) if g is None]
        if unused:
            warnings.warn(
                f"clipped_grad: the loss does not depend on differentiated parameter(s) "
                f"{unused[:10]}; they receive no gradient and would be trained on noise alone. "
                "Freeze them (requires_grad_(False) before make_functional(..., "
                "partition_trainable=True)) or drop them from the differentiated dict.",
                OpakePrivacyWarning,
                stacklevel=3,
            )


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")
