"""Level 2's per-example check: secret rows again, each alone, and one against plain autograd.

The unsharded engine compares its norms with per-example autograd on one example
(:mod:`opake.dpsgd.bookkeeping._check`); through a ``fully_shard``-ed module that would run
collectives on some ranks only and let FSDP reduce one rank's gradient alone. Here every rank
re-runs the loss on a batch of ONE row, for each of ``ROWS`` of its rows — drawn with the
operating system's secret randomness among its real rows (padding rows when it has too few)
— through the same runner, so every rank runs the same FSDP collectives and the backward is
w.r.t. the runner's sink. A row's pieces depend on the other rows exactly when something
mixes examples (a batch mean, batch statistics, a layer run with the batch dimension moved),
so its per-leaf norms alone must match its norms in the batch within the certified bounds
and the tolerance of two fp32 computations; a row whose loss fails alone (the batch ran)
mismatches too. The ranks then agree (one all-gather of each rank's verdict, the row it
offers and a secret number): a mismatch anywhere raises
:class:`~opake.dpsgd.bookkeeping._check.BookkeepingMismatchError` on every rank, before the
call returns its sums, and refuses every later call.

What both runs miss alike — a parameter read outside the layer that holds it, whose use no
rule records — is compared next, on one offered row chosen by the secret numbers, with plain
autograd of that row's loss through the sharded module (:mod:`._autograd`, every rank running
the same collectives); a mismatch raises and refuses the same way, saying to read each
parameter inside its own layer.

Due on the first chunk, then every ``RECHECK_EVERY`` chunks — a count identical on every rank
(every rank runs the same chunks, :mod:`._batch`). A check that compared nothing anywhere (no
row with a finite, non-zero gradient on some rank, or no autograd comparison) stays due.
"""

from __future__ import annotations

import math
import secrets
from typing import TYPE_CHECKING, Any, NoReturn

from opake.dpsgd.bookkeeping._check import INCONCLUSIVE as INCONCLUSIVE_CHECK
from opake.dpsgd.bookkeeping._check import RECHECK_EVERY, BookkeepingMismatchError
from opake.dpsgd.distributed.sharded._autograd import DRAW_RANGE, autograd_check

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._chunk import BookkeepingChunk
    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = ["RowCheck"]

AGREE, INCONCLUSIVE, MISMATCH = 0, 1, 2
#: rows compared per check, each alone: a mixing that depends on the batch's values (a sign
#: the batch decides) agrees on a row whose own value decides alike; on 4 drawn rows of every
#: rank, rarely (the red team's sign mixer: an estimated 1 check in 300 passes)
ROWS = 4


class RowCheck:
    """The check's state on one rank: the chunk count, the last checked chunk, a refusal."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._chunks = 0
        self._checked: int | None = None
        #: set on every rank once a check failed: every later call raises it
        self.refused: str | None = None

    def refuse_if_failed(self) -> None:
        """Raise the recorded mismatch (before any collective: every rank holds it)."""
        if self.refused is not None:
            raise BookkeepingMismatchError(self.refused)

    def __call__(
        self,
        runner: BookkeepingRunner,
        args: tuple[Any, ...],
        chunk: BookkeepingChunk,
        is_real: torch.Tensor | None,
    ) -> None:
        """Check ``chunk`` (the run of ``args``) when due; raises on every rank on a mismatch."""
        import torch.distributed as dist

        self._chunks += 1
        if self._checked is not None and self._chunks - self._checked < RECHECK_EVERY:
            return
        drawn = _draw(chunk, is_real, min(ROWS, int(chunk.leaf_sq.shape[0])))
        code, detail = _rows_alone(runner, args, chunk, drawn)
        first, usable = drawn[0]
        offer = first if usable and (is_real is None or bool(is_real[first])) else -1
        everyone = self._agree(code, offer)
        codes = [c for c, _, _ in everyone]
        if MISMATCH in codes:
            self._refuse(_ROWS_MISMATCH.format(where=detail or "on another rank"))
        rank = dist.get_rank(self._group) if len(everyone) > 1 else 0
        offers = [(row, draw) for _, row, draw in everyone]
        alone = _row_of(runner, args, first)
        found, _ = autograd_check(runner, alone, chunk, offers, rank=rank, group=self._group)
        if found is not None and found != INCONCLUSIVE_CHECK:
            self._refuse(_AUTOGRAD_MISMATCH.format(where=found))
        if max(codes) == AGREE and found is None:
            self._checked = self._chunks

    def _agree(self, code: int, offer: int) -> list[tuple[int, int, int]]:
        """Every rank's (row check's code, row offered to the autograd check or -1, secret
        number), by rank: one all-gather."""
        import torch
        import torch.distributed as dist

        from opake.dpsgd.distributed._replicas import _gather_rows

        mine = (code, offer, secrets.randbelow(DRAW_RANGE))
        if not (dist.is_initialized() and dist.get_world_size(self._group) > 1):
            return [mine]
        row = torch.tensor(mine, dtype=torch.float64)
        rows = _gather_rows(row, group=self._group, world_size=dist.get_world_size(self._group))
        return [(int(c), int(r), int(d)) for c, r, d in rows.tolist()]

    def _refuse(self, message: str) -> NoReturn:
        """Refuse this call and every later one (on every rank: each raises alike)."""
        self.refused = message
        raise BookkeepingMismatchError(message)


_ROWS_MISMATCH = (
    "sharded book-keeping: a row's per-example norms from a batch of one disagree with the "
    "same row's in its batch ({where}): the loss mixes examples, the model moves the batch "
    "dimension, or it normalises with batch statistics (a batch norm in training mode, "
    "F.batch_norm(training=True)); per-example clipping would not bound one example's "
    "influence. Example i's loss must depend on example i alone (and be deterministic: "
    "dropout in training mode is not supported here)"
)
_AUTOGRAD_MISMATCH = (
    "sharded book-keeping and plain autograd through the fully_shard-ed module disagree on "
    "{where}: a parameter is used where no layer's book-keeping rule records it, read "
    "outside the layer that holds it (e.g. an output head computed as "
    "F.linear(h, self.embed.weight)), so its share of the gradient would be missing from the "
    "clipped sums. Read each parameter only inside its own layer: tie such a head as a "
    "module (head = nn.Linear(d, vocab, bias=False); head.weight = embed.weight), which the "
    "engine records"
)


def _rows_alone(
    runner: BookkeepingRunner,
    args: tuple[Any, ...],
    chunk: BookkeepingChunk,
    drawn: list[tuple[int, bool]],
) -> tuple[int, str]:
    """This rank's verdict on its ``drawn`` rows, each run alone and compared with the batch
    run (:data:`MISMATCH` first, then :data:`AGREE`), and a mismatch's description."""
    found: dict[int, str] = {}
    for row, usable in drawn:
        try:
            alone = runner.run(_row_of(runner, args, row), 1)
        except Exception as err:  # the batch ran: alone, it depends on the others
            found[MISMATCH] = f"example {row} alone fails: {type(err).__name__}: {err}"
            break  # the same shapes on every rank: raised everywhere
        if usable:
            result, what = _compare(runner, args, chunk, alone, row)
            found.setdefault(result, what)
    code = min(found, key=(MISMATCH, AGREE, INCONCLUSIVE).index, default=INCONCLUSIVE)
    return code, found.get(MISMATCH, "")


def _draw(
    chunk: BookkeepingChunk, is_real: torch.Tensor | None, count: int
) -> list[tuple[int, bool]]:
    """``count`` distinct rows drawn with secret randomness among the real rows whose norms
    are finite, then (when too few) among the padding ones; ``False``: a row that only keeps
    the collectives aligned (no finite norm to compare)."""
    import torch

    bound = chunk.leaf_sq if chunk.clip_sq is None else chunk.clip_sq
    finite = torch.isfinite(bound.sum(dim=1)) & torch.isfinite(chunk.leaf_sq.sum(dim=1))
    real = finite if is_real is None else finite & is_real.to(finite.device)
    picked: list[tuple[int, bool]] = []
    rows = torch.ones_like(finite)
    for pool, usable in ((real, True), (finite, True), (rows, False)):
        taken = {r for r, _ in picked}
        candidates = [r for r in pool.nonzero().flatten().tolist() if r not in taken]
        while candidates and len(picked) < count:
            picked.append((candidates.pop(secrets.randbelow(len(candidates))), usable))
    return picked


def _row_of(runner: BookkeepingRunner, args: tuple[Any, ...], row: int) -> tuple[Any, ...]:
    """``args`` with every batched argument cut to row ``row`` (a batch of one)."""
    import torch
    from torch.utils._pytree import tree_map

    def cut(x: object) -> object:
        return x[row : row + 1] if isinstance(x, torch.Tensor) else x

    return tuple(tree_map(cut, a) if i in runner.batch_argnums else a for i, a in enumerate(args))


def _compare(
    runner: BookkeepingRunner,
    args: tuple[Any, ...],
    chunk: BookkeepingChunk,
    alone: BookkeepingChunk,
    row: int,
) -> tuple[int, str]:
    """Row ``row``'s per-leaf norms alone against its norms in the batch, as
    :func:`~opake.dpsgd.bookkeeping._check.verify` compares autograd's: the norm alone must
    lie in ``[norm − (bound − norm) − margin, bound + margin]`` of the batch run's."""
    import torch

    diff = args[runner.argnums]
    want = [float(v) for v in alone.leaf_sq[0].detach().double().cpu()]
    have = [float(v) for v in chunk.leaf_sq[row].detach().double().cpu()]
    clip = chunk.leaf_sq if chunk.clip_sq is None else chunk.clip_sq
    bounds = [float(v) for v in clip[row].detach().double().cpu()]
    if not all(math.isfinite(v) for v in want):
        return MISMATCH, f"example {row}: a finite gradient in its batch, not alone"
    if not (sum(want) > 0.0 or sum(have) > 0.0):  # zero on both sides proves nothing
        return INCONCLUSIVE, ""
    low = runner._half or any(v.dtype not in (torch.float32, torch.float64) for v in diff.values())
    tol = (5e-2 if low else 1e-4) * max(math.sqrt(sum(want)), math.sqrt(sum(have)), 1e-12)
    zero = [0.0] * len(want)
    ours = zero if chunk.rounding is None else chunk.rounding[row].cpu().tolist()
    theirs = zero if alone.rounding is None else alone.rounding[0].cpu().tolist()
    for name, w, h, b, r, s in zip(diff, want, have, bounds, ours, theirs, strict=True):
        got, norm, bound = math.sqrt(w), math.sqrt(h), math.sqrt(b)
        margin = tol + sum(v for v in (r, s) if math.isfinite(v))
        if got > bound + margin or got < norm - (bound - norm) - margin:
            return MISMATCH, (
                f"example {row}, {name!r}: norm {norm:.6g} in its batch (certified bound "
                f"{bound:.6g}), {got:.6g} alone"
            )
    return AGREE, ""
