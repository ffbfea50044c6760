"""Every rank runs the same number of forwards: batches padded to the ranks' largest, masked.

FSDP's forward and backward hooks all-gather each unit's parameters: collectives that every
rank must enter the same number of times, in the same order. Under Poisson sampling each rank's
shard of the global batch has its own size, so the chunks (``microbatch_size``) a rank runs
would differ — a deadlock, or collectives silently paired across different calls. Each call
therefore agrees on the largest local batch (one all-reduce MAX of an integer) and pads every
rank's batch to it with all-zero rows that ``example_mask`` marks as padding: they run through
the model and contribute exactly zero (``clipped_grad``'s padding semantics), and every rank
runs the same chunks. A global batch of zero examples runs no forward anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opake.dpsgd.clipping._call import batch_size, check_mask
from opake.dpsgd.distributed._replicas import _comm_device

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
) -> tuple[tuple[Any, ...], torch.Tensor | None, int]:
    """``(args, mask, local)``: the batched arguments padded to the ranks' largest batch.

    ``positions`` are the batched arguments; ``mask`` the user's ``example_mask`` (checked).
    The returned mask marks the padding rows ``False`` (``None``: no padding, no user mask);
    ``local`` is this rank's own batch size.
    """
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_map

    local = batch_size(args, positions)
    checked = check_mask(mask, local, device)
    size = torch.tensor([local], dtype=torch.int64, device=_comm_device(group))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    pad = int(size.item()) - local
    if pad == 0:
        return args, checked, local

    def padded(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])

    call = tuple(tree_map(padded, a) if i in positions else a for i, a in enumerate(args))
    real = torch.ones(local, dtype=torch.bool, device=device) if checked is None else checked
    return call, torch.cat([real, torch.zeros(pad, dtype=torch.bool, device=device)]), local
