"""DPO pairs weighed by the clipped forward itself, inside a ``DPTraining`` step.

On the book-keeping engine, each pair's weight (the DPO loss's derivative, from the pair's
margin) can come from the clipped forward that records the layers (:meth:`DPOLoss.pairs`),
which saves the forward without gradient that :meth:`DPOLoss.prepare` takes. Two things make
that possible only at some calls: the engine must evaluate whole pairs (the ``vmap`` engine
evaluates rows alone and raises :class:`PairsNeedBookkeepingError`), and when the call falls
back to ``vmap``, ``DPTraining`` drops the pending step, which must then hold nothing but this
batch (so that weighing it first and clipping it again redoes the same step).
:func:`weighs_in_forward` says when to try; :func:`accumulate_pairs` tries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from opake.transformers.losses._dpo import PairsNeedBookkeepingError

if TYPE_CHECKING:
    import torch

    from opake.transformers.losses._dpo import DPOLoss

__all__ = ["accumulate_pairs", "weighs_in_forward"]

logger = logging.getLogger("opake.transformers")


def weighs_in_forward(training: Any) -> bool:
    """Whether ``training``'s next ``accumulate`` should weigh DPO pairs in its own forward:
    no physical batch of the step is pending, and the engine is book-keeping — the engine of
    the last call, or, before the first call, any engine asked for but ``"vmap"`` (a first call
    that then takes ``vmap`` falls back once, see :func:`accumulate_pairs`).

    >>> from types import SimpleNamespace as NS
    >>> weighs_in_forward(NS(pending_batches=0, grad_fn=NS(engine=None, requested_engine="auto")))
    True
    >>> weighs_in_forward(NS(pending_batches=0, grad_fn=NS(engine="vmap", requested_engine="auto")))
    False
    """
    if training.pending_batches:
        return False
    grad_fn = training.grad_fn
    if grad_fn.engine is None:
        return bool(grad_fn.requested_engine != "vmap")
    return bool(grad_fn.engine == "bookkeeping")


def accumulate_pairs(
    dpo: DPOLoss,
    training: Any,
    rows: dict[str, torch.Tensor],
    *,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    ids: torch.Tensor | None = None,
    example_mask: torch.Tensor | None = None,
    records: list[int] | None = None,
) -> tuple[Any, torch.Tensor] | None:
    """Accumulate ``rows`` (``2P`` rows: chosen, then rejected) into ``training``'s step with
    each pair's weight from the clipped forward itself; returns ``(aux, margins)`` (the margins
    in pair order: **not private**, diagnostics), or ``None`` when the call took the ``vmap``
    engine: ``DPTraining`` then dropped the pending step (call this only when
    :func:`weighs_in_forward` says so), and the caller weighs the batch with
    :meth:`DPOLoss.prepare` and accumulates it again.

    ``records``: each row's record, the pairs' indices from ``training.batches()`` twice
    (``indices * 2``: a pair's two rows name its record). Each pair's two rows are one privacy
    unit (``units=``, by pair id), which ``DPTraining`` checks against ``records`` (each unit
    one drawn record); with privacy units (``training.privacy_unit == "unit"``) the training
    groups the records itself (``records=`` alone). Without ``records`` the step is refused.
    """
    import torch

    ready, units = dpo.pairs(rows, ref_chosen=ref_chosen, ref_rejected=ref_rejected, ids=ids)
    given = None if training.privacy_unit == "unit" else units  # unit sampler: from records
    dpo.seen.clear()
    try:
        aux = training.accumulate(ready, example_mask=example_mask, units=given, records=records)
    except PairsNeedBookkeepingError:
        logger.info("DPO pairs: this batch took the vmap engine; its pairs are weighed first")
        return None
    finally:
        seen, dpo.seen = dpo.seen, []
    by_id = {int(i): m for pairs in seen for i, m in zip(pairs.ids, pairs.margins, strict=True)}
    order = units[: units.numel() // 2].tolist()
    margins = torch.stack([by_id[i] for i in order]) if order else torch.zeros(0)
    return aux, margins
