"""Every rank runs the same number of forwards: batches padded to the ranks' largest, masked.

FSDP's forward and backward hooks all-gather each unit's parameters: collectives that every
rank must enter the same number of times, in the same order. Under Poisson sampling each rank's
shard of the global batch has its own size, so the chunks (``microbatch_size``) a rank runs
would differ — a deadlock, or collectives silently paired across different calls. Each call
therefore agrees on the largest local batch (one all-reduce MAX of an integer) and pads every
rank's batch to it with all-zero rows that ``example_mask`` marks as padding: they run through
the model and contribute exactly zero (``clipped_grad``'s padding semantics), and every rank
runs the same chunks. A global batch of zero examples runs no forward anywhere.

The same collective lines the ranks up (:func:`~opake.dpsgd.distributed._agree.line_up`: one
all-gather of a fixed-size row per rank): this call's place in its logical step (calls since
the last ``end_step=True``), its ``end_step``, ``microbatch_size`` and ``reduce_scatter`` must
be equal on every rank, or every rank raises the same
:class:`~opake.core.errors.ConfigurationError` — not a hang or a collective paired with another
call's; a rank that calls ``ShardedDPOptimizer.step()`` instead (it lines up the same way)
makes every rank raise :class:`~opake.core.errors.OperationError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.clipping._call import batch_size, check_mask
from opake.dpsgd.distributed._agree import CALL, line_up, out_of_step

if TYPE_CHECKING:
    import torch

__all__ = ["agreed_batch"]


def agreed_batch(
    args: tuple[Any, ...],
    positions: tuple[int, ...],
    mask: object,
    *,
    group: Any,
    device: torch.device,
    calls: tuple[int, int, int, int] = (1, 1, 0, 0),
    names: int = 0,
) -> tuple[tuple[Any, ...], torch.Tensor | None, int]:
    """``(args, mask, local)``: the batched arguments padded to the ranks' largest batch.

    ``positions`` are the batched arguments; ``mask`` the user's ``example_mask`` (checked);
    ``calls``: (this call's place in its logical step, ``end_step``, ``microbatch_size`` or 0,
    ``reduce_scatter``), which every rank must pass alike, as ``names`` (a fingerprint of the
    trainable parameters' names: the ranks reduce the same sums in the same order). The
    returned mask marks the padding rows ``False`` (``None``: no padding, no user mask);
    ``local`` is this rank's own batch size.
    """
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_map

    local = batch_size(args, positions)
    checked = check_mask(mask, local, device)
    index, end_step, microbatch, scatter = calls
    fields = {
        "batch": local,
        "index": index,
        "end_step": end_step,
        "microbatch": microbatch,
        "scatter": scatter,
        "names": names,
    }
    rows = [{"kind": CALL, **fields}]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        rows = line_up(CALL, group, **fields)
    problem = out_of_step(rows)
    if problem is not None:
        raise OperationError(f"{problem} (this is rank {dist.get_rank(group)})")
    if len({row["names"] for row in rows}) > 1:
        raise ConfigurationError(
            "sharded grad_fn: the ranks' trainable parameters differ (requires_grad set on "
            "some ranks only): every rank must train the same parameters, or their clipped "
            "sums would be reduced against different parameters; set requires_grad alike on "
            "every rank before training"
        )
    agreed = ("index", "end_step", "microbatch", "scatter")
    low = [min(row[k] for row in rows) for k in agreed]
    high = [max(row[k] for row in rows) for k in agreed]
    if high != low:
        raise ConfigurationError(
            "sharded grad_fn: every rank must call grad_fn the same number of times per "
            "logical step (end_step) with the same microbatch_size and reduce_scatter; across "
            f"the ranks this call is call {low[0]}..{high[0]} of its step, end_step "
            f"{bool(low[1])}..{bool(high[1])}, microbatch_size {low[2] or None}.."
            f"{high[2] or None}, reduce_scatter {bool(low[3])}..{bool(high[3])}"
        )
    pad = max(row["batch"] for row in rows) - local
    if pad == 0:
        return args, checked, local

    def padded(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])

    call = tuple(tree_map(padded, a) if i in positions else a for i, a in enumerate(args))
    real = torch.ones(local, dtype=torch.bool, device=device) if checked is None else checked
    return call, torch.cat([real, torch.zeros(pad, dtype=torch.bool, device=device)]), local
