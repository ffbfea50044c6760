"""``DPTraining(compile=True)``: the clipped-gradient call compiled for one batch shape.

``torch.compile`` specialises a graph to its input shapes, and ``vmap`` does not trace with a
symbolic batch size, so a Poisson batch of a new size would compile again (seconds each, and
torch falls back to eager after a few). The compiled step therefore sees one shape only: each
physical batch is cut into chunks of ``rows`` rows, the last one padded by repeating the
batch's first row with ``example_mask`` False (a masked row gets clip factor 0 and its
non-finite entries are zeroed first, so it adds exactly zero to the sum), and the chunks' clipped
sums are added before the optimizer sees them. What the compiled graph computes is the eager
vmap engine's math (the certified norms are the eager code itself, see
``opake.dpsgd.clipping._compiled``), so the per-example bound holds as proven.

The book-keeping engine (a ``BatchedLoss`` whose differentiated parameters are not a small part
of the model, or ``engine="bookkeeping"``) compiles its batched forward and backward instead
(``opake.dpsgd.bookkeeping._compiled``): norms, bounds and the clipped sum stay the eager code.
Refused at construction, with the reason: privacy units and adaptive clipping (neither traces
in one graph). Group clipping compiles with one graph break (its group lookup), so it is
compiled without ``fullgraph``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.certify import ieee_compile_options

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.clipping import ClipAux, ClippedGrads, ClipState

__all__ = ["CompiledStep", "check_compile", "compiled_rows"]

_LOG = logging.getLogger("opake.core")


def compiled_rows(
    microbatch: int | None, *, fixed_rows: int | None, poisson: tuple[int, str] | None = None
) -> tuple[int | None, str]:
    """The rows of every compiled call, and why: *microbatch* (given or chosen), else the slots
    of a fixed-shape batch (*fixed_rows*), else the caller's one shape for Poisson batches
    (*poisson*: its rows and why; ``None``: no shape, which ``compile=True`` refuses).

    The one rule of ``DPTraining(compile=True)``, ``opake train --compile`` and
    ``DPTrainer(torch_compile=True)``.

    >>> compiled_rows(8, fixed_rows=40)
    (8, 'the microbatch')
    >>> compiled_rows(None, fixed_rows=40)
    (40, "the fixed-shape batch's slots")
    >>> compiled_rows(None, fixed_rows=None, poisson=(22, "the largest likely Poisson batch"))
    (22, 'the largest likely Poisson batch')
    """
    if microbatch is not None:
        return microbatch, "the microbatch"
    if fixed_rows is not None:
        return fixed_rows, "the fixed-shape batch's slots"
    return poisson if poisson is not None else (None, "Poisson batches vary in size")


def check_compile(
    compile: object,
    *,
    engine: str,
    clipping_norm: object,
    units: object,
    microbatch_size: int | None,
    fixed_rows: int | None,
) -> tuple[str, int | None, bool]:
    """Validate ``compile=`` against the other choices; return the engine, the chunk rows
    and whether the graph must be whole (``False`` for group clipping: one graph break).

    ``fixed_rows``: ``B_max`` of fixed-shape sampling (``None`` for Poisson). The chunk size is
    ``microbatch_size``, else ``B_max``; Poisson sampling without ``microbatch_size`` is
    refused (its batches have no one shape). Without ``compile`` nothing changes.
    """
    from opake.dpsgd.clipping import AdaptiveClipping, GroupClipping

    if not isinstance(compile, bool):
        raise InputTypeError(f"compile={compile!r}: expected True or False")
    if not compile:
        return engine, microbatch_size, True
    if units is not None:
        raise ConfigurationError(
            "compile=True with privacy_units: the plan that keeps each unit's rows in one chunk "
            "is host-side and does not trace; train user-level DP with compile=False"
        )
    if isinstance(clipping_norm, AdaptiveClipping):
        raise ConfigurationError(
            "compile=True with AdaptiveClipping: its state is rebuilt in Python at every call "
            "and does not trace; use fixed, AUTO-S or group clipping, or compile=False"
        )
    if microbatch_size is not None:
        from opake.dpsgd.training._options import _positive

        microbatch_size = _positive("microbatch_size", microbatch_size, integer=True)
    rows, _ = compiled_rows(microbatch_size, fixed_rows=fixed_rows)
    if rows is None:
        raise ConfigurationError(
            "compile=True compiles one batch shape, and Poisson batches vary in size: pass "
            "microbatch_size=m (each physical batch runs as chunks of m rows, the last one "
            "padded and masked), or use sampler='fixed'"
        )
    return engine, rows, not isinstance(clipping_norm, GroupClipping)


class CompiledStep:
    """Call a ``clipped_grad`` function compiled once, on chunks of ``rows`` rows.

    The engine is chosen at the first call (:meth:`route`): the book-keeping engine, its
    recording compiled, where ``grad_fn`` would run book-keeping on a model whose differentiated
    parameters are not a small part of it; otherwise the vmap engine, ``grad_fn`` compiled whole.

    Args:
        grad_fn: the eager ``grad_fn`` (``return_aux=True``, one chunk per call).
        rows: the rows of every compiled call.
        fullgraph: whether the graph must be whole (``False`` for group clipping only).
    """

    def __init__(self, grad_fn: Callable[..., Any], rows: int, *, fullgraph: bool) -> None:
        self.rows = rows
        self._grad_fn = grad_fn
        self._fullgraph = fullgraph
        self._first = True
        #: ``"bookkeeping"`` (recording compiled) or ``"vmap"`` (compiled whole); set by the
        #: first call
        self.engine: str | None = None
        self._compiled: Callable[..., Any] = grad_fn  # the vmap route's compiled grad_fn

    def route(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """What every call runs: chosen once, from the first call's arguments (logged)."""
        if self.engine is None:
            choose = getattr(self._grad_fn, "compiled_engine", None)
            self.engine = "vmap" if choose is None else choose(args)
            if self.engine == "bookkeeping":
                self._grad_fn._bookkeeping.compile_recording()  # type: ignore[attr-defined]
                _LOG.info(
                    "compile=True: the book-keeping engine, its batched forward and backward "
                    "compiled (norms, bounds and the clipped sum eager)"
                )
            else:
                import torch

                _LOG.info("compile=True: the vmap engine, the clipped-gradient call compiled")
                self._compiled = torch.compile(
                    self._grad_fn,
                    fullgraph=self._fullgraph,
                    dynamic=False,
                    options=ieee_compile_options(),
                )
        return self._grad_fn if self.engine == "bookkeeping" else self._compiled

    def __call__(
        self,
        params: Any,
        args: tuple[Any, ...],
        batch: tuple[Any, ...],
        *,
        state: ClipState,
        example_mask: torch.Tensor | None,
    ) -> tuple[ClippedGrads, ClipAux, ClipState]:
        """One physical batch: its clipped sum, its aux (the chunks' merged, padding rows
        dropped) and the new clip state."""
        import torch

        from opake.dpsgd.clipping._call import check_mask

        size, device = _batch_size(batch)
        checked = check_mask(example_mask, size, device)  # as eager: bool [B], else an error
        mask = torch.ones(size, dtype=torch.bool, device=device) if checked is None else checked
        total: ClippedGrads | None = None
        chunks: list[tuple[ClipAux, torch.Tensor]] = []
        for start in range(0, max(size, 1), self.rows):
            stop = min(start + self.rows, size)
            chunk, chunk_mask = _padded(batch, mask, start, stop, self.rows)
            (grads, aux), state = self._call(
                params, *args, *chunk, state=state, example_mask=chunk_mask, end_step=False
            )
            chunks.append((aux, chunk_mask))
            # ClippedGrads addition keeps the sensitivity (each example is in one chunk)
            total = grads if total is None else total + grads
        assert total is not None  # at least one chunk, an empty batch's included
        return total, _merged(chunks, size), state

    def _call(self, *args: Any, **kwargs: Any) -> tuple[tuple[ClippedGrads, ClipAux], ClipState]:
        start = time.perf_counter()
        try:
            # grad_fn's ((grads, aux), state): return_aux=True, a flat dict of params
            call = self.route(args)
            out: tuple[tuple[ClippedGrads, ClipAux], ClipState] = call(*args, **kwargs)
        except Exception as err:
            failure = _compile_failure(err)
            if failure is None:
                raise
            raise failure from err
        if self._first:
            self._first = False
            _LOG.info(
                "compile=True: %s for chunks of %d rows in %.1f s",
                "the DP step compiled"
                if self.engine == "vmap"
                else "the first chunk recorded eagerly (the next one compiles the recording)",
                self.rows,
                time.perf_counter() - start,
            )
        return out


def _compile_failure(err: Exception) -> OperationError | None:
    """An ``OperationError`` for a failure of ``torch.compile`` itself (``None`` for any
    other error, which propagates as it is), naming the first error that is not the
    compiler's: a user's error raised while tracing is reported with its own message."""
    import torch._dynamo.exc as dynamo

    if isinstance(err, OperationError) or not isinstance(
        err, dynamo.TorchDynamoException | dynamo.FailOnRecompileLimitHit
    ):
        return None
    inner: BaseException = err
    seen: set[int] = set()
    while id(inner) not in seen:
        seen.add(id(inner))
        module = type(inner).__module__
        if not module.startswith(("torch._dynamo", "torch._inductor")):
            break
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    detail = f"{type(inner).__name__}: {' '.join(lines[:2]) if lines else repr(inner)}"
    if isinstance(err, dynamo.FailOnRecompileLimitHit) or "recompile limit" in str(err).lower():
        hint = (
            "each new input shape (e.g. a sequence length) compiles again; pad every batch to "
            "one shape"
        )
    elif inner is not err:
        hint = "the error was raised while tracing the loss: check it with compile=False"
    else:
        hint = (
            "the loss function must trace under vmap(grad) as one graph (no .item(), "
            "data-dependent branches or unsupported calls); train with compile=False"
        )
    return OperationError(f"compile=True: torch.compile failed on the DP step ({detail}); {hint}")


def _leaves(batch: tuple[Any, ...]) -> list[torch.Tensor]:
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise InputTypeError("compile=True: the batched arguments hold no tensor")
    return leaves


def _batch_size(batch: tuple[Any, ...]) -> tuple[int, torch.device]:
    """The batch's rows and device (its first tensor's), from one walk of its leaves."""
    leaves = _leaves(batch)
    if any(t.dim() == 0 for t in leaves):
        raise ConfigurationError(
            "compile=True: a batched argument is a 0-d tensor; every batched tensor needs a "
            "leading batch dimension (one row per example)"
        )
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) != 1:
        raise ConfigurationError(
            f"compile=True: every batched tensor needs the same leading (batch) dimension, "
            f"got sizes {sorted(sizes)}"
        )
    return sizes.pop(), leaves[0].device


def _padded(
    batch: tuple[Any, ...], mask: torch.Tensor, start: int, stop: int, rows: int
) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Rows ``start:stop`` of every batched tensor, padded to ``rows`` by repeating the batch's
    first row (row 0 of an empty batch does not exist: zeros), with the mask padded False."""
    import torch
    from torch.utils._pytree import tree_map

    pad = rows - (stop - start)

    def cut(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        part = t[start:stop]
        if pad == 0:
            return part
        shape = (pad, *t.shape[1:])
        filler = t[:1].expand(shape) if t.shape[0] else t.new_zeros(shape)
        return torch.cat([part, filler])

    chunk_mask = torch.cat([mask[start:stop], mask.new_zeros(pad)]) if pad else mask[start:stop]
    return tree_map(cut, batch), chunk_mask


def _merged(chunks: list[tuple[ClipAux, torch.Tensor]], size: int) -> ClipAux:
    """The physical batch's ``ClipAux``: per-example fields concatenated over the chunks with
    the padding rows dropped, counts summed, the clipping rate over all real examples."""
    import torch
    from torch.utils._pytree import tree_map

    auxes = [aux for aux, _ in chunks]
    if len(auxes) == 1 and int(auxes[0].loss_values.shape[0]) == size:
        return auxes[0]

    def rows(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values)[:size]

    real = torch.stack([a.batch_size for a in auxes])
    clipped = torch.stack([a.clipping_rate.double() * a.batch_size for a in auxes]).sum()
    count = real.sum()
    rate = (clipped / count.clamp(min=1)).to(auxes[0].clipping_rate.dtype)
    group = None
    maps = [a.group_grad_norms for a in auxes if a.group_grad_norms is not None]
    if maps:
        group = {k: rows([m[k] for m in maps]) for k in maps[0]}
    loss_aux = None
    if auxes[0].loss_aux is not None:
        rest = [a.loss_aux for a in auxes[1:]]
        loss_aux = tree_map(lambda *xs: rows(list(xs)), auxes[0].loss_aux, *rest)
    return dataclasses.replace(
        auxes[0],
        loss_values=rows([a.loss_values for a in auxes]),
        grad_norms=rows([a.grad_norms for a in auxes]),
        clipped_grad_norms=rows([a.clipped_grad_norms for a in auxes]),
        clipping_rate=rate,
        batch_size=count,
        nonfinite_count=torch.stack([a.nonfinite_count for a in auxes]).sum(),
        loss_aux=loss_aux,
        group_grad_norms=group,
    )
