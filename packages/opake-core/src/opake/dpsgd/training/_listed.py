"""``accumulate(records=...)`` without units: each row names the drawn example it holds.

A loop that loads rows other than the drawn ones (one drawn example twice, another left out)
sums as many rows as were drawn and so passes the step's count check (:mod:`._drawn`), while
the repeated example moves the clipped sum by 2·C. Naming each row's record lets the step check
the rows themselves: every real row (``example_mask`` True) is a record the sampler drew for
the step, no record is summed twice (in one physical batch or two), and by the end of the step
every drawn record came. What it cannot see is a row whose *data* is not the record it names:
load ``X[indices]`` with the indices ``training.batches()`` yielded and pass the same indices.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError
from opake.dpsgd.training._units import StepRecords, _batch_leaf, _kept_rows, _record_list

if TYPE_CHECKING:
    import torch

__all__ = ["ListedRecords"]


class ListedRecords(StepRecords):
    """The records named by a step's plain physical batches (``records=`` without ``units=``).

    >>> import torch
    >>> from opake.dpsgd.sampling import PoissonSampler
    >>> listed = ListedRecords(PoissonSampler(4, 1.0, seed=0))  # drawn: 0, 1, 2, 3
    >>> listed.check([0, 1], (torch.zeros(2, 3),), None, step=0, world_size=1)
    [0, 1]
    >>> try:  # record 2 twice, record 3 left out
    ...     listed.check([2, 2], (torch.zeros(2, 3),), None, step=0, world_size=1)
    ... except ConfigurationError:
    ...     print("refused")
    refused
    """

    def check(
        self,
        records: object,
        batch: tuple[Any, ...],
        mask: torch.Tensor | None,
        *,
        step: int,
        world_size: int,
    ) -> list[int]:
        """The real rows' records of one physical batch (to :meth:`commit`), after checking
        that each is drawn for ``step``, once in the step."""
        if world_size > 1:
            raise ConfigurationError(
                f"accumulate(records=...) with {world_size} ranks: each rank's rows are "
                "checked against the whole draw, not its own share; pass records= in one "
                "process, or leave it out (the step's count check still runs)"
            )
        leaf = _batch_leaf(batch)
        rows = None if leaf is None else int(leaf.shape[0])
        listed = _record_list(records, rows)
        keep = _kept_rows(mask, len(listed))
        listed = [r for r, kept in zip(listed, keep, strict=True) if kept]
        twice = sorted(r for r, n in Counter(listed).items() if n > 1)
        if twice:
            raise ConfigurationError(
                f"accumulate(records=...): record(s) {twice[:10]} name several rows of this "
                "physical batch; each drawn example is one row, clipped and summed once. Load "
                "X[indices] with the indices training.batches() yielded; to clip several rows "
                "of one example together (a DPO pair), pass units= with records="
            )
        self._records.check_records(listed, step=step)
        return listed

    MISSING = (
        "records=: {missing} of the {drawn} example(s) the sampler drew for this step came in "
        "no physical batch; a step's batches that pass records= must hold every drawn record "
        "(rows loaded other than the drawn ones would repeat some example in their place); "
        "the step was dropped"
    )
