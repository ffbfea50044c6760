"""The book-keeping runner: per-example norms and the clipped sum from one backward.

One ordinary batched forward of a :class:`~opake.dpsgd.bookkeeping.BatchedLoss` runs with
forward hooks on every layer that uses a trainable parameter: the hook keeps the layer's input
and routes its output through an identity autograd node whose backward keeps the output
gradient. One ``backward`` of ``Σ_i loss_i`` (w.r.t. a scalar sink only, so autograd computes
activation gradients and no weight gradient at all) then leaves, per layer use, the pieces that
the layer's rule (:mod:`opake.dpsgd.bookkeeping.rules`) builds. Norms and the clipped sum come
from those pieces. Whether a call runs it at all is clipping's choice
(:mod:`opake.dpsgd.clipping._choice`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.bookkeeping._certify import certified_operator, exact_block
from opake.dpsgd.bookkeeping._check import (
    INCONCLUSIVE,
    RECHECK_EVERY,
    BookkeepingInconclusiveError,
    BookkeepingMismatchError,
    BookkeepingUnsupportedError,
    check_examples,
    settings_key,
    verify,
)
from opake.dpsgd.bookkeeping._chunk import BookkeepingChunk
from opake.dpsgd.bookkeeping._compiled import CompiledRecording
from opake.dpsgd.bookkeeping._fused import LeafBoundsFn
from opake.dpsgd.bookkeeping._loss import BatchedLoss
from opake.dpsgd.bookkeeping._pieces import Implicit, Piece
from opake.dpsgd.bookkeeping._plan import BookkeepingPlan, bookkeeping_plan
from opake.dpsgd.bookkeeping._recording import (
    _RECORDING,
    Tap,
    holding,
    implicit_pieces,
    rule_pieces,
)
from opake.dpsgd.bookkeeping._trust import TRUST_ENV, trusted_names
from opake.dpsgd.bookkeeping._units import RowUnits, UnitsUnsupportedError, regroup
from opake.dpsgd.bookkeeping._use import LayerRule, LayerUse
from opake.dpsgd.certify import FINAL, GramCache, full_precision, measure_blocks, scaled_add_error

if TYPE_CHECKING:
    import torch

__all__ = ["BookkeepingRunner"]


#: a loose leaf's excess (bound² − computed²) below this share of its example's squared bound
#: is not worth the exact route: skipping it clips at most ``√(1 + leaves·2⁻²⁰)`` harder
MATTERS = 2.0**-20


def _matters(leaf_sq: torch.Tensor, clip_sq: torch.Tensor) -> torch.Tensor:
    """``[m, leaves]``: where a loose bound could change the example's clip factor — its excess
    over the computed norm is more than :data:`MATTERS` of the example's squared bound (or not
    finite). Elsewhere (an all-zero gradient's underflow allowance, say, beside ordinary
    leaves) the certified bound is used as it is: a utility choice, the bound holds either way.

    >>> import torch
    >>> _matters(torch.tensor([[0.0, 1.0]]), torch.tensor([[1e-34, 1.5]])).tolist()
    [[False, True]]
    """
    import torch

    excess = clip_sq - leaf_sq
    total = clip_sq.sum(dim=1, keepdim=True)
    finite = torch.isfinite(excess) & torch.isfinite(total)
    return ~finite | (excess > total * MATTERS)


class BookkeepingRunner:
    """Runs the book-keeping engine for one :class:`BatchedLoss` (used by ``clipped_grad``)."""

    def __init__(
        self,
        loss: BatchedLoss[object],
        *,
        argnums: int,
        batch_argnums: tuple[int, ...],
        has_aux: bool,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.loss = loss
        #: names of rules and operators outside the proof the user trusts (plus the environment)
        self.trusted = trusted_names(trusted)
        self.argnums = argnums
        self.batch_argnums = batch_argnums
        self.has_aux = has_aux
        self._plans: dict[tuple[str, ...], BookkeepingPlan] = {}
        self._recording = False
        self._uses: list[LayerUse] = []
        self._sink: torch.Tensor | None = None
        self._batch = 0
        self._diff: Mapping[str, torch.Tensor] = {}
        self._by_module: dict[int, LayerRule] = {}
        self._inside: set[int] = set()  # layers an implicit use recorded inside their forward
        self._half = False
        self._layout: tuple[str, ...] = ()  # the layers the last forward used, in order
        self._calls = 0
        self._verified: dict[tuple[Any, ...], int] = {}  # structure -> call of its last check
        self.verified = False
        self.disabled: str | None = None  # set when the check failed (auto falls back)
        #: why privacy units cannot run here (an implicit piece): unit calls use vmap
        self.units_refused: str | None = None
        #: the compiled recording (``DPTraining(compile=True)``), else ``None``: eager
        self.compiled: CompiledRecording | None = None
        self.bounds = LeafBoundsFn()  # compiled with the recording

    def compile_recording(self) -> None:
        """Record with a compiled forward and backward from now on (:mod:`._compiled`)."""
        if self.compiled is None:
            self.compiled = CompiledRecording(self)
            self.bounds = LeafBoundsFn(compiled=True)

    def plan(self, names: tuple[str, ...]) -> BookkeepingPlan:
        """The (cached) plan for these differentiated names."""
        if names not in self._plans:
            self._plans[names] = bookkeeping_plan(self.loss.module, names, trusted=self.trusted)
        return self._plans[names]

    # ------------------------------------------------------------------ recording
    def _hook(self, layer: LayerRule) -> Callable[..., Any]:
        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: object
        ) -> torch.Tensor | None:
            import torch

            if not self._recording:
                return None
            if id(module) in self._inside:  # its forward recorded its parameters' use itself
                self._inside.discard(id(module))
                return None
            if not torch.is_grad_enabled() or self._sink is None:
                raise OperationError(
                    f"book-keeping: layer {layer.module!r} ran outside the recorded forward "
                    "(under no_grad, or recomputed by activation checkpointing in backward); "
                    "use clipped_grad(engine='vmap') for such models"
                )
            params = self._layer_params(layer, module)
            if not isinstance(output, torch.Tensor):
                raise OperationError(
                    f"book-keeping: layer {layer.module!r} returned a {type(output).__name__}; "
                    "its rule needs a single tensor output. Use clipped_grad(engine='vmap')"
                )
            spec = layer.spec
            assert spec is not None
            if spec.broadcast and self._batch > 1 and args:
                x = args[0]
                if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                    # a batch-broadcast input (e.g. position ids [1, T]): the output is shared by
                    # every example, so give each example its own view; the gradient reaching
                    # the tap is then per example instead of summed over the batch
                    args = (x.expand(self._batch, *x.shape[1:]), *args[1:])
                    output = output.expand(self._batch, *output.shape[1:])
            use = LayerUse(layer, module, args, kwargs, params, self._batch)
            use.shape, use.dtype = tuple(output.shape), output.dtype
            if spec.keeps_output:
                use.output = output.detach()
            self._uses.append(use)
            return Tap.apply(output, self._sink, use)

        return hook

    def _layer_params(self, layer: LayerRule, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The parameters ``module`` runs with (attribute → tensor), checked to be the
        differentiated tensors (a subclass that runs the module's own parameters, e.g. under
        FSDP, checks them its way)."""
        params = {attr: getattr(module, attr) for attr in module._parameters}
        for attr, name in layer.params:
            if params[attr] is not self._diff[name]:
                raise OperationError(
                    f"book-keeping: layer {layer.module!r} ran with a {attr!r} that is not "
                    f"the differentiated tensor {name!r}; the loss must run the model "
                    "through fmodel(params, ...) with the dict clipped_grad passes"
                )
        return params

    def _hold(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """What the module holds during the backward: the differentiated tensors
        (:func:`holding`, for activation checkpointing); a subclass whose module runs its own
        parameters (FSDP swaps them itself) holds nothing."""
        return holding(module, self._diff)

    def _forward_backward(
        self, args: tuple[Any, ...], batch: int
    ) -> tuple[torch.Tensor, Any, list[LayerUse]]:
        import torch

        plan = self.plan(tuple(args[self.argnums]))
        module = self.loss.module
        by_name = dict(module.named_modules(remove_duplicate=False))
        handles = [
            by_name[layer.module].register_forward_hook(self._hook(layer), with_kwargs=True)
            for layer in plan.layers
        ]
        self._uses = []
        self._inside = set()
        self._batch = batch
        self._diff = args[self.argnums]
        self._by_module = {id(by_name[layer.module]): layer for layer in plan.layers}
        self._sink = torch.zeros((), requires_grad=True)
        self._recording = True
        token = _RECORDING.set(self)
        try:
            with torch.enable_grad():
                losses, aux = self._split(self.loss.fn(*args), batch)
                self._recording = False
                if losses.requires_grad:
                    with self._hold(module):
                        torch.autograd.backward(losses.sum(), inputs=[self._sink])
        finally:
            _RECORDING.reset(token)
            self._recording = False
            self._sink = None
            self._by_module = {}
            for handle in handles:
                handle.remove()
        uses, self._uses = self._uses, []
        self._diff = {}
        self._note(uses)
        return losses.detach(), aux, uses

    def _split(self, out: Any, batch: int) -> tuple[torch.Tensor, Any]:
        """The batched loss's output as ``(losses [batch], aux)``, checked."""
        import torch

        if self.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConfigurationError(
                    f"BatchedLoss fn returned a {type(out).__name__}; with has_aux=True "
                    "it must return a pair (losses [B], aux)"
                )
            losses, aux = out
        else:
            losses, aux = out, None
        if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (batch,):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else losses
            raise ConfigurationError(
                f"BatchedLoss fn returned {shape} for a batch of {batch}; expected "
                f"per-example losses of shape [{batch}] (reduce over each example's "
                "tokens only: causal_lm_losses(logits, labels), or a patched model's "
                "loss_only=True, per_example_loss=True)"
            )
        return losses, aux

    def _note(self, uses: list[LayerUse]) -> None:
        """What a recording's uses tell the check: the layers used, in order, and whether
        activations are half precision (autocast, or a half model: the first-call check
        compares with per-example autograd at half-precision tolerance)."""
        import torch

        self._layout = tuple(use.layer.module for use in uses)
        self._half = any(use.grad_dtype in (torch.float16, torch.bfloat16) for use in uses)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _pieces(use: LayerUse, batch: int) -> list[tuple[str, Piece]]:
        """The pieces of one use: built in the backward (an eager rule), or now."""
        if use.built is not None:
            return use.built
        if use.grad is None:
            return []
        if use.build is not None:
            return implicit_pieces(use, batch)
        return rule_pieces(use)

    def _vet(self, use: LayerUse, piece: Piece) -> None:
        """An implicit piece outside the proof needs the user's trust (else OperationError)."""
        if not isinstance(piece, Implicit) or certified_operator(piece.op):
            return
        op = type(piece.op)
        names = {use.layer.rule, op.__qualname__, f"{op.__module__}.{op.__qualname__}"}
        if names & self.trusted:
            return
        raise use.fail(
            f"its per-example gradients are held by {op.__module__}.{op.__qualname__}, an "
            "operator that does not prove its norm bounds (outside the clipping proof); name "
            f"it or the rule {use.layer.rule!r} in clipped_grad(trusted_rules=...) or "
            f"{TRUST_ENV} to use it anyway"
        )

    def _unit_pieces(
        self, uses: list[LayerUse], batch: int, units: RowUnits
    ) -> dict[str, list[Piece]]:
        """The pieces regrouped per privacy unit (:mod:`._units`), each use's recording let go
        as soon as its pieces are regrouped."""
        pieces: dict[str, list[Piece]] = {}
        try:
            for use in uses:
                for name, piece in self._pieces(use, batch):
                    self._vet(use, piece)
                    pieces.setdefault(name, []).append(regroup(piece, units))
                use.args, use.kwargs, use.grad, use.output, use.built = (), {}, None, None, None
        except UnitsUnsupportedError as err:
            self.units_refused = str(err)
            raise
        finally:
            units.release()
            uses.clear()
        return pieces

    def run(
        self, args: tuple[Any, ...], batch: int, units: RowUnits | None = None
    ) -> BookkeepingChunk:
        """Forward + backward on one microbatch; certified bounds per leaf and the pieces.

        With ``units`` every result but the losses and aux is per unit (:mod:`._units`): the
        pieces are regrouped before any norm, bound or sum is computed from them.
        """
        import torch

        diff = args[self.argnums]
        names = tuple(diff)
        record = self._forward_backward if self.compiled is None else self.compiled.forward_backward
        losses, aux, uses = record(args, batch)
        pieces: dict[str, list[Piece]] = {}
        if units is not None:
            pieces = self._unit_pieces(uses, batch, units)
            batch = units.count
        else:
            for use in uses:
                for name, piece in self._pieces(use, batch):
                    self._vet(use, piece)
                    pieces.setdefault(name, []).append(piece)
        device = losses.device
        zeros = torch.zeros(batch, dtype=torch.float64, device=device)
        sq, bound, slack, loose, rounding = [], [], [], [], []
        grams = GramCache()  # one input Gram matrix, shared by consecutive uses of that input
        with full_precision():
            for name in names:
                own = pieces.get(name, [])
                if not own:
                    sq.append(zeros)
                    bound.append(zeros)
                    slack.append(zeros)
                    loose.append(zeros > 0)
                    rounding.append(zeros)
                    continue
                leaf = self.bounds(own, diff[name].numel(), grams)
                sq.append(leaf.sq)
                bound.append(leaf.bound)
                slack.append(leaf.slack)
                loose.append(leaf.loose)
                rounding.append(leaf.rounding)
        if not sq:
            empty = torch.zeros(batch, 0, dtype=torch.float64, device=device)
            return BookkeepingChunk(losses, empty, aux, pieces, empty)
        leaf_sq = torch.stack(sq, dim=1)
        clip_sq = torch.stack(bound, dim=1).square()
        chunk = BookkeepingChunk(losses, leaf_sq, aux, pieces, clip_sq, None, torch.stack(slack, 1))
        chunk.rounding = torch.stack(rounding, dim=1)
        exact = torch.stack(loose, dim=1) & _matters(leaf_sq, clip_sq)
        if not bool(exact.any()):
            return chunk
        chunk.exact = exact
        with full_precision():  # a loose bound: measure those examples' gradients exactly
            for i, j in exact.nonzero().tolist():
                own = pieces[names[j]]
                shape = tuple(diff[names[j]].shape)

                def block(start: int, stop: int, own: Any = own, i: int = i) -> torch.Tensor:
                    return exact_block(own, i, start, stop)

                hat, up, parts = measure_blocks(block, shape)
                rel, abs_ = scaled_add_error(up.sqrt(), diff[names[j]].numel())
                leaf_sq[i, j] = hat
                clip_sq[i, j] = ((up.sqrt() + rel) * FINAL).square()
                assert chunk.slack is not None
                chunk.slack[i, j] = abs_ * FINAL
                chunk.parts[(i, j)] = parts
        return chunk

    def shapes(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Differentiated names and dtypes; batched arguments' shapes (no batch) and dtypes."""
        import torch
        from torch.utils._pytree import tree_leaves

        diff = args[self.argnums]
        batched = tuple(
            (tuple(x.shape[1:]), str(x.dtype))
            for pos in self.batch_argnums
            for x in tree_leaves(args[pos])
            if isinstance(x, torch.Tensor)
        )
        return tuple((name, str(value.dtype)) for name, value in diff.items()), batched

    def structure(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What a passed check covers: :meth:`shapes`, the recorded layer uses, and the
        modules' plain attributes and other arguments (:func:`~._check.settings_key`)."""
        skip = (self.argnums, *self.batch_argnums)
        return *self.shapes(args), self._layout, settings_key(self.loss.module, args, skip)

    def run_checked(
        self,
        args: tuple[Any, ...],
        batch: int,
        per_example: Callable[..., Any],
        *,
        check: bool,
        units: RowUnits | None = None,
    ) -> BookkeepingChunk:
        """:meth:`run`, then (when ``check`` and due) :meth:`verify` on an example (a unit,
        with ``units``: its rows' gradients summed) with a non-zero gradient.

        Due: on every structure not yet verified (:meth:`structure`), and every
        ``RECHECK_EVERY`` calls. Raises :class:`BookkeepingMismatchError` (book-keeping is then
        off for good) or :class:`BookkeepingInconclusiveError` (no example could be compared:
        this call must not use the unchecked result). An :class:`OperationError` while
        recording (a layer its rule cannot handle) turns book-keeping off for good and is
        re-raised as :class:`BookkeepingUnsupportedError` (a mismatch: ``"auto"`` falls back);
        pieces that cannot be regrouped per unit raise :class:`UnitsUnsupportedError` (unit
        calls then take the vmap engine; book-keeping stays on for the others).
        """
        try:
            chunk = self.run(args, batch, units)
        except (BookkeepingMismatchError, BookkeepingInconclusiveError, UnitsUnsupportedError):
            raise
        except OperationError as err:
            self.disabled = f"recording failed ({err})"
            raise BookkeepingUnsupportedError(str(err)) from err
        if not check or batch == 0:
            return chunk
        self._calls += 1
        key = (*self.structure(args), units is not None)
        last = self._verified.get(key)
        # a newly compiled graph is checked whatever the key: its trace may differ from eager
        fresh = self.compiled is not None and self.compiled.fresh
        if last is not None and not fresh and self._calls - last < RECHECK_EVERY:
            return chunk
        compared = 0
        for index in check_examples(chunk):
            rows = None if units is None else units.members(index)
            mismatch = self.verify(per_example, args, chunk, index, rows=rows)
            if mismatch == INCONCLUSIVE:
                continue
            compared += 1
            if mismatch is not None:
                self.disabled = f"the check against per-example autograd failed ({mismatch})"
                raise BookkeepingMismatchError(
                    f"book-keeping and per-example autograd disagree on {mismatch}: the loss "
                    "mixes examples, the model moves the batch dimension, or a parameter is "
                    "read outside a hooked layer. Use clipped_grad(engine='vmap')"
                )
        if not compared:
            raise BookkeepingInconclusiveError(
                "book-keeping check inconclusive: no example of this batch has a finite, "
                "non-zero gradient that per-example autograd could compare"
            )
        self._verified.pop(key, None)
        self._verified[key] = self._calls
        if len(self._verified) > 256:  # settings that change every call: keep the newest keys
            del self._verified[next(iter(self._verified))]
        self.verified = True
        return chunk

    def verify(
        self,
        per_example: Callable[..., Any],
        args: tuple[Any, ...],
        chunk: BookkeepingChunk,
        index: int = 0,
        *,
        rows: list[int] | None = None,
    ) -> str | None:
        """:func:`~._check.verify` example ``index`` of ``chunk`` against plain autograd
        (``rows``: the rows of unit ``index``, each example's gradient summed)."""
        return verify(self, per_example, args, chunk, index, rows=rows)
