"""Level 2's check against plain autograd: one example's loss alone, through the FSDP module.

The row check (:mod:`._check`) compares the engine with itself — a row alone, the same row in
its batch — so what no layer rule records at all is missed alike by both runs: a parameter read
outside the layer that holds it (an output head computed as ``F.linear(h, self.embed.weight)``
instead of a tied ``nn.Linear``) loses its share of the gradient from the clipped sum. The
unsharded engine catches it against per-example autograd
(:func:`~opake.dpsgd.bookkeeping._check.verify`); level 2 does the same comparison, on the
calls where the row check runs, for one example:

- the ranks agree on it in the row check's all-gather: every rank offers its first secretly
  drawn row (a real one, when it has one) and a secret number; the sum of the numbers, modulo
  the count, picks one offering rank (unpredictable while one rank's number is secret);
- every rank runs its offered row's loss alone through the ``fully_shard``-ed module and a
  backward into the parameters — the chosen rank's loss weighted 1, the others' 0, so every
  rank runs the same FSDP collectives — with FSDP's gradient reduction switched on for this one
  backward, as a plain SUM (gradient divide factor 1): FSDP gathers each unit, computes the
  chosen example's ordinary gradient and reduce-scatters it, one unit at a time;
- each rank's squared norm of its shard of every gradient, summed over the ranks by one
  all-reduce that also carries the chosen rank's book-keeping norms and bounds of that row,
  gives every rank the same figures, compared by
  :func:`~opake.dpsgd.bookkeeping._check.compare_norms`: the same verdict on every rank.

The parameters' ``.grad`` (``None``, or the optimizer's last noisy gradient) are put back and
FSDP's reduction switched off again whatever happens: nothing reaches the optimizer's sums.
FSDP's divide factor stays 1 with forced SUM reductions (level 2 never lets FSDP reduce
otherwise). Cost, per check: one example's forward and backward on every rank, one
reduce-scatter per FSDP unit, one all-reduce of ``4 × leaves`` floats.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from opake.dpsgd.bookkeeping._check import (
    INCONCLUSIVE,
    compare_norms,
    low_precision,
    row_norms,
)
from opake.dpsgd.distributed._replicas import _comm_device
from opake.dpsgd.distributed._rows import _local
from opake.dpsgd.distributed.sharded._plan import reshard_units

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._chunk import BookkeepingChunk
    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = ["autograd_check", "fsdp_sum", "pick", "set_fsdp_reduction"]

#: the range of the secret numbers the ranks add up to pick the example (exact in float64)
DRAW_RANGE = 2**40


def set_fsdp_reduction(model: torch.nn.Module, enabled: bool) -> None:
    """Switch FSDP's own gradient reduction on or off on every unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)


@contextlib.contextmanager
def fsdp_sum(model: torch.nn.Module) -> Iterator[None]:
    """FSDP reduces the gradients of the backward run inside: a plain SUM over the ranks."""
    from torch.distributed.fsdp import FSDPModule

    try:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
                module.set_requires_gradient_sync(True, recurse=False)
        yield
    finally:
        set_fsdp_reduction(model, False)


def pick(offers: Sequence[tuple[int, int]]) -> int | None:
    """The rank whose row is compared: ``offers[r]`` is rank r's (offered row or -1, secret
    number); the numbers' sum, modulo the count, picks among the ranks that offer a row."""
    ranks = [r for r, (row, _) in enumerate(offers) if row >= 0]
    if not ranks:
        return None
    return ranks[sum(draw for _, draw in offers) % len(ranks)]


def _plain_sq(runner: BookkeepingRunner, args: tuple[Any, ...], weight: float) -> torch.Tensor:
    """``weight`` × the loss of ``args`` (a batch of one) through the module, FSDP's gradient
        reduction on: this rank's squared norm of its shard of each leaf's reduced gradient (fp64,
    on the host).

        FSDP puts the reduced gradient on its sharded parameters, so they are read from the
        module after ``reshard()`` (which registers them again), not from the call's
        differentiated tensors: those are the parameters registered when the call started, FSDP's
        gathered ones for a unit left gathered then (the root after a forward without backward,
        an evaluation)."""
    import torch

    module = runner.loss.module
    reshard_units(module)
    named = dict(module.named_parameters())
    params = [named.get(name, value) for name, value in args[runner.argnums].items()]
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        with torch.enable_grad(), fsdp_sum(module):
            out: Any = runner.loss.fn(*args)
            losses: torch.Tensor = out[0] if runner.has_aux else out
            torch.autograd.backward(losses.sum() * weight)
        sq = [
            torch.zeros((), dtype=torch.float64, device=_local(p).device)
            if p.grad is None
            else _local(p.grad).detach().double().square().sum()
            for p in params
        ]
        return torch.stack([v.to(sq[0].device) for v in sq]).cpu()  # one copy to the host
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad


def autograd_check(
    runner: BookkeepingRunner,
    alone: tuple[Any, ...],
    chunk: BookkeepingChunk,
    offers: Sequence[tuple[int, int]],
    *,
    rank: int,
    group: Any,
) -> tuple[str | None, int | None]:
    """Compare the chosen offer's per-leaf norms in ``chunk`` with plain autograd through the
    module (a collective). ``offers``: every rank's (row of ``chunk`` or -1, secret number);
    ``alone``: the arguments of this rank's row, a batch of one (its offer, or any row: with
    weight 0 it only keeps the collectives aligned); ``rank``: this rank's place in ``offers``.
    Returns (the mismatch, ``None`` if every leaf agrees, or ``"inconclusive"``; the chosen
    rank), the same on every rank."""
    import torch
    import torch.distributed as dist

    chosen = pick(offers)
    if chosen is None:
        return INCONCLUSIVE, None
    diff = alone[runner.argnums]
    own = rank == chosen
    figures = torch.zeros(4, len(diff), dtype=torch.float64)
    figures[0] = _plain_sq(runner, alone, 1.0 if own else 0.0)
    if own:
        figures[1:] = torch.tensor(row_norms(chunk, offers[rank][0]), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        summed = figures.to(_comm_device(group))
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        figures = summed.cpu()
    want, have, bounds, rounding = figures.tolist()
    what = f"example {offers[chosen][0]} of rank {chosen}'s batch"
    low = low_precision(runner, diff)
    scale = math.sqrt(sum(want)) if sum(want) >= 0 else math.nan
    found = compare_norms(diff, want, have, bounds, rounding, scale=scale, low=low, what=what)
    return found, chosen
