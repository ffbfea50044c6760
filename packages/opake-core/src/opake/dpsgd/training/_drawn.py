"""Before the noise: a logical step summed no more examples than its sampler drew.

Each drawn example may move the step's clipped sum by at most C, once. Two ways of summing more
rows than were drawn pass every per-batch check: the padding slots of a fixed-shape batch summed
without ``example_mask`` (they hold ``PADDING_INDEX`` = −1, which indexes the *last* record,
clipped and added once per slot, in every step), and a drawn batch accumulated twice. Every
physical batch reports how many examples it summed (``ClipAux.batch_size``: rows with
``example_mask`` True, or units with ``units=``); their total must not exceed the sampler's
count for the step (:meth:`~opake.dpsgd.sampling.PoissonSampler.drawn_count`). The optimizer
refuses the step (on every rank, in its per-step agreement, under ``torch.distributed``).

Which drawn batch a step holds: the one of step ``steps`` (the steps released so far) in a
plain loop over ``DPTraining.batches()`` — exactly what the sampler handed out last, and the
bound is that batch's count. Where the sampler has handed out more (a dropped step, after
which a loop may retry the same batch or go on with the next; a loop drawing ahead, like a
prefetching loader) the step's batch is one of those handed out from step ``steps`` on, and
the bound is the largest of their counts (at most :data:`_RECENT` of them): a drawn batch
summed twice then passes when another of them holds twice as many examples. ``DPTrainer``
checks every physical batch's indices against the draw itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["drawn_problem"]

#: the most recent handed-out batches a step may hold (a sampler remembers 16)
_RECENT = 8


def drawn_problem(pending: Sequence[tuple[Any, Any]], sampler: Any, step: int) -> str | None:
    """Why the step may not be released (``None``: it may) when its physical batches
    (``pending``: each batch's ``(aux, example_mask)``) summed more examples than ``sampler``
    drew for ``step`` on this rank.

    >>> from types import SimpleNamespace
    >>> from opake.dpsgd.sampling import PoissonSampler
    >>> sampler = PoissonSampler(10, 1.0, seed=0)  # every example drawn
    >>> drawn_problem([(SimpleNamespace(batch_size=10), None)], sampler, 0) is None
    True
    >>> print(drawn_problem([(SimpleNamespace(batch_size=10), None)] * 2, sampler, 0))
    step 0: its physical batches summed 20 examples, but the sampler drew 10 for it on this rank; each drawn example is summed once. Pass example_mask=padding_mask(indices) with fixed-shape batches (their padding slots hold PADDING_INDEX = -1, which indexes the last record), and accumulate each drawn batch once. Nothing was noised: the step is dropped
    """  # noqa: E501 - the doctest's expected message is one line
    summed = sum(int(aux.batch_size) for aux, _ in pending)
    position = int(sampler.position)
    first = max(step, position - _RECENT)
    drawn = max(sampler.drawn_count(s) for s in range(first, max(position, step + 1)))
    if summed <= drawn:
        return None
    return (
        f"step {step}: its physical batches summed {summed} examples, but the sampler drew "
        f"{drawn} for it on this rank; each drawn example is summed once. Pass "
        "example_mask=padding_mask(indices) with fixed-shape batches (their padding slots hold "
        "PADDING_INDEX = -1, which indexes the last record), and accumulate each drawn batch "
        "once. Nothing was noised: the step is dropped"
    )
