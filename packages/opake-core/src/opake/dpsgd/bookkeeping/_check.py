"""The book-keeping engine's check against plain autograd, on examples it cannot steer.

The engine's norms come from its layer rules; what no rule can see — a loss that mixes
examples, a model that moves the batch dimension, a parameter read outside its layer — shows up
as a disagreement with plain autograd on one example alone. The examples compared are not
chosen by the engine's own computed norms alone (an example crafted to look small would never
be checked): one is drawn with the operating system's secret randomness, then the largest and
the smallest computed norm. The comparison goes both ways. The privacy guarantee does not rest
on this check (the bounds are proven, see :mod:`._certify`); it guards the rules' coverage.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._certify import TINY
from opake.dpsgd.bookkeeping._recording import holding

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._chunk import BookkeepingChunk
    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = [
    "INCONCLUSIVE",
    "RECHECK_EVERY",
    "BookkeepingInconclusiveError",
    "BookkeepingMismatchError",
    "BookkeepingUnsupportedError",
    "check_examples",
    "compare_norms",
    "low_precision",
    "row_norms",
    "settings_key",
    "vector_gap",
    "verify",
]


class BookkeepingMismatchError(OperationError):
    """The check found book-keeping and per-example autograd disagree."""


class BookkeepingInconclusiveError(OperationError):
    """The check could not compare any example: the call falls back to the vmap engine."""


class BookkeepingUnsupportedError(BookkeepingMismatchError):
    """Recording failed on a layer its rule cannot handle: book-keeping is off for this
    ``clipped_grad`` (``"auto"`` falls back to the vmap engine, ``"bookkeeping"`` raises)."""


#: calls between two checks of an already verified structure
RECHECK_EVERY = 64
INCONCLUSIVE = "inconclusive"

#: the non-batched arguments' plain values a check is keyed on (other objects: their type)
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


#: a non-batched tensor of at most this many entries is keyed by its values (a setting)
_SETTING_NUMEL = 8


def settings_key(
    module: torch.nn.Module, args: Sequence[Any], skip: Iterable[int]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What else a passed check holds for: every submodule's public plain attributes (its
    training flag among them), and the arguments at positions not in ``skip`` (the
    differentiated and batched ones) — their plain values, small tensors' values (at most
    :data:`_SETTING_NUMEL` entries), other tensors' shapes and dtypes, other objects' types. A
    change of any (``train()`` after the check, a flag set on a layer, a Python or scalar-tensor
    setting the loss branches on) makes the next call a structure to check again: a model can
    mix examples in one mode or setting only.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Dropout(0.5))
    >>> settings_key(net.eval(), ({}, 1.5, torch.ones(1), torch.zeros(9)), skip=(0,))[1]
    (1.5, (1.0,), ((9,), 'torch.float32'))
    """
    import torch
    from torch.utils._pytree import tree_leaves

    attrs = tuple(
        tuple((k, v) for k, v in vars(m).items() if k[0] != "_" and isinstance(v, _PLAIN))
        for m in module.modules()
    )
    skipped = set(skip)
    values: list[Any] = []
    for pos, arg in enumerate(args):
        if pos in skipped:
            continue
        for leaf in tree_leaves(arg):
            if isinstance(leaf, torch.Tensor) and leaf.numel() <= _SETTING_NUMEL:
                values.append(tuple(leaf.detach().flatten().tolist()))
            elif isinstance(leaf, torch.Tensor):
                values.append((tuple(leaf.shape), str(leaf.dtype)))
            elif isinstance(leaf, _PLAIN):
                values.append(leaf)
            else:
                values.append(type(leaf).__qualname__)
    return attrs, tuple(values)


def check_examples(chunk: BookkeepingChunk) -> list[int]:
    """The examples the check compares, never chosen by the computed norms alone: one
    drawn with the operating system's secret randomness among those whose bound is finite and
    above ``TINY``, then the largest and the smallest computed norm among them."""
    import torch

    bound = chunk.leaf_sq if chunk.clip_sq is None else chunk.clip_sq
    total, computed = bound.sum(dim=1), chunk.leaf_sq.sum(dim=1)
    usable = torch.isfinite(total) & (total > TINY * TINY) & torch.isfinite(computed)
    usable = usable.nonzero()
    candidates = usable.flatten().tolist()
    if not candidates:
        return []
    values = computed[usable.flatten()]
    drawn = candidates[secrets.randbelow(len(candidates))]
    picks = [drawn, candidates[int(values.argmax())], candidates[int(values.argmin())]]
    return list(dict.fromkeys(picks))


def verify(
    runner: BookkeepingRunner,
    per_example: Callable[..., Any],
    args: tuple[Any, ...],
    chunk: BookkeepingChunk,
    index: int = 0,
    *,
    rows: Sequence[int] | None = None,
) -> str | None:
    """Compare example ``index``'s per-leaf norms with plain autograd on it alone, both
    ways: autograd's norm must lie below the certified bound and above the computed norm
    less the bound's margin (within the tolerance of two fp32 computations of a model).

    With privacy units, ``index`` is a unit and ``rows`` its rows: autograd runs on each row
    alone and their gradients are summed in fp64 (the tolerance then scales with the sum of
    the rows' norms, which is what fp32 rounding scales with when rows cancel).

    Guards against what no rule can see: a loss that mixes examples, a model that moves
    the batch dimension, a parameter read outside its layer. Returns the mismatch, ``None``
    if every leaf agrees, or ``"inconclusive"`` when autograd's norm is not finite.
    """
    diff = args[runner.argnums]
    total: list[torch.Tensor | None] = [None] * len(diff)
    scale = 0.0
    for row in [index] if rows is None else rows:
        got = _autograd(runner, per_example, args, row)
        row_sq = 0.0
        for k, grad in enumerate(got):
            if grad is None:
                continue
            g = grad.double()
            row_sq += float(g.square().sum())
            prev = total[k]
            total[k] = g if prev is None else prev + g
        scale += math.sqrt(row_sq) if math.isfinite(row_sq) else math.inf
    want = [0.0 if g is None else float(g.square().sum()) for g in total]
    if rows is None:
        scale = math.sqrt(sum(want))
    have, bounds, rounding = row_norms(chunk, index)
    what = f"{'example' if rows is None else 'unit'} {index}"
    low = low_precision(runner, diff)
    norms = compare_norms(diff, want, have, bounds, rounding, scale=scale, low=low, what=what)
    if norms is not None:
        return norms
    tol = _tolerance(scale, low)
    for k, name in enumerate(diff):
        own = chunk.pieces.get(name)
        if not own:  # book-keeping's gradient is zero: the norms decided
            continue
        gap = vector_gap(own, index, total[k], tuple(diff[name].shape))
        slack = max(math.sqrt(bounds[k]) - math.sqrt(have[k]), 0.0)
        allowance = tol + slack + (rounding[k] if math.isfinite(rounding[k]) else 0.0)
        if gap > allowance:
            return (
                f"{what}, {name!r}: book-keeping's gradient is {gap:.6g} away from per-example "
                f"autograd's (norms {math.sqrt(have[k]):.6g} and {math.sqrt(want[k]):.6g})"
            )
    return None


def vector_gap(
    pieces: Sequence[Any], index: int, reference: torch.Tensor | None, shape: tuple[int, ...]
) -> float:
    """``‖G − reference‖`` for example ``index``'s leaf gradient ``G`` held by ``pieces``
    (fp64 rows, block by block: the exact route's :func:`~._pieces.example_rows`), against
    per-example autograd's fp64 gradient (``None``: zero). Norms alone cannot see a loss that
    mixes examples by turning gradients (a sign set by another example): the check compares
    the vectors too.

    >>> import torch
    >>> from opake.dpsgd.bookkeeping._pieces import Dense
    >>> vector_gap([Dense(torch.tensor([[3.0, 4.0]]))], 0, -torch.tensor([3.0, 4.0]), (2,))
    10.0
    """
    import torch

    from opake.dpsgd.bookkeeping._pieces import example_rows

    rows = shape[0] if shape else 1
    width = max(1, math.prod(shape[1:]))
    ref = None if reference is None else reference.double().reshape(rows, width)
    step = max(1, (1 << 22) // width)  # about 4 M fp64 entries per block
    sq = 0.0
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = example_rows(pieces[0], index, start, stop)
        for piece in pieces[1:]:
            block = block + example_rows(piece, index, start, stop)
        block = block.reshape(stop - start, width)
        if ref is not None:
            block = block - ref[start:stop].to(block.device)
        sq += float(torch.sum(block * block))
    return math.sqrt(sq)


def row_norms(chunk: BookkeepingChunk, index: int) -> tuple[list[float], list[float], list[float]]:
    """Example ``index``'s per-leaf figures in ``chunk``: the computed squared norms, the
    certified squared bounds, and the bounds' fp32 rounding allowance (zeros when none)."""
    have = [float(v) for v in chunk.leaf_sq[index].detach().double().cpu()]
    clip = chunk.leaf_sq if chunk.clip_sq is None else chunk.clip_sq
    bounds = [float(v) for v in clip[index].detach().double().cpu()]
    rounding = [0.0] * len(have)
    if chunk.rounding is not None:
        rounding = [float(v) for v in chunk.rounding[index].detach().double().cpu()]
    return have, bounds, rounding


def low_precision(runner: BookkeepingRunner, diff: Mapping[str, torch.Tensor]) -> bool:
    """Whether the last run computed in half precision (then the comparison's tolerance is
    a half-precision one)."""
    import torch

    return runner._half or any(v.dtype not in (torch.float32, torch.float64) for v in diff.values())


def compare_norms(
    names: Iterable[str],
    want: Sequence[float],
    have: Sequence[float],
    bounds: Sequence[float],
    rounding: Sequence[float],
    *,
    scale: float,
    low: bool,
    what: str,
) -> str | None:
    """The comparison of :func:`verify`, per leaf: plain autograd's squared norms ``want``
    against the engine's computed ``have`` and certified ``bounds`` (squared) with their
    ``rounding``; the tolerance of two fp32 (``low``: half-precision) computations scales with
    ``scale``. ``None``: every leaf agrees; ``"inconclusive"``: a figure is not finite or both
    sides are zero; else the mismatch, ``what`` (the example) and the leaf named."""
    if not all(math.isfinite(v) for v in [*want, *have, *bounds]):
        return INCONCLUSIVE
    if not (sum(want) > 0.0 or sum(have) > 0.0):  # zero on both sides proves nothing
        return INCONCLUSIVE
    tol = _tolerance(scale, low)
    for name, w, h, b, r in zip(names, want, have, bounds, rounding, strict=True):
        got_norm, norm, bound = math.sqrt(w), math.sqrt(h), math.sqrt(b)
        margin = tol + (r if math.isfinite(r) else 0.0)  # autograd's own fp32 rounding
        if got_norm > bound + margin or got_norm < norm - (bound - norm) - margin:
            return (
                f"{what}, {name!r}: book-keeping norm {norm:.6g} (certified "
                f"bound {bound:.6g}), per-example autograd norm {got_norm:.6g}"
            )
    return None


def _tolerance(scale: float, low: bool) -> float:
    """What two fp32 (``low``: half-precision) computations of a model may differ by, for a
    gradient of norm ``scale``."""
    return (5e-2 if low else 1e-4) * max(scale, 1e-12)


def _autograd(
    runner: BookkeepingRunner, per_example: Callable[..., Any], args: tuple[Any, ...], row: int
) -> tuple[torch.Tensor | None, ...]:
    """Plain autograd of row ``row``'s loss alone (``None`` for a leaf it does not use)."""
    import torch
    from torch.utils._pytree import tree_map

    diff = args[runner.argnums]
    leaves = {k: v.detach().requires_grad_(True) for k, v in diff.items()}
    call = [
        tree_map(lambda x: x[row] if isinstance(x, torch.Tensor) else x, a)
        if i in runner.batch_argnums
        else a
        for i, a in enumerate(args)
    ]
    call[runner.argnums] = leaves
    with torch.enable_grad():
        out = per_example(*call)
        loss = out[0] if runner.has_aux else out
        with holding(runner.loss.module, leaves):
            got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return tuple(got)
