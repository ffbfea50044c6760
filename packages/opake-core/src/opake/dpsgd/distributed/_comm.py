"""Collective helpers shared by the distributed modules: flat, bucketed fp32 reductions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["all_reduce_tensors", "broadcast_tensors", "fingerprint", "max_all_reduce"]

#: Elements per flat bucket (fp32: 64 MiB). Larger reductions are split so the temporary copy
#: stays bounded; every rank builds the same buckets from the same shapes.
BUCKET_NUMEL = 16 * 1024 * 1024
#: Elements per chunk of :func:`fingerprint` (bounds its float64 temporaries to 32 MiB).
FINGERPRINT_CHUNK = 4 * 1024 * 1024


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> Iterator[list[int]]:
    bucket: list[int] = []
    size = 0
    for i, tensor in enumerate(tensors):
        if bucket and size + tensor.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += tensor.numel()
    if bucket:
        yield bucket


def all_reduce_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    group: Any = None,
    device: torch.device | None = None,
    bucket_numel: int = BUCKET_NUMEL,
) -> list[torch.Tensor]:
    """SUM-all-reduce ``tensors`` in fp32 through flat buckets; return new tensors.

    Each result has its input's shape and device and dtype fp32. ``device`` is where the flat
    buckets live (the backend's device: CUDA for nccl, CPU for gloo); default: the first
    tensor's.
    """
    import torch
    import torch.distributed as dist

    if not tensors:
        return []
    where = device if device is not None else tensors[0].device
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket in _buckets(tensors, bucket_numel):
        flat = torch.cat(
            [tensors[i].detach().reshape(-1).to(device=where, dtype=torch.float32) for i in bucket]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for i in bucket:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view(tensors[i].shape).to(tensors[i].device)
            offset += n
    return [t for t in out if t is not None]


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    src: int = 0,
    group: Any = None,
    device: torch.device | None = None,
    bucket_numel: int = BUCKET_NUMEL,
) -> None:
    """Copy rank ``src``'s values into ``tensors`` on every rank, in place (any dtype).

    Tensors are bucketed by dtype so no value is converted on the way.
    """
    import torch
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype in sorted(by_dtype, key=str):
        group_tensors = by_dtype[dtype]
        where = device if device is not None else group_tensors[0].device
        for bucket in _buckets(group_tensors, bucket_numel):
            flat = torch.cat([group_tensors[i].detach().reshape(-1).to(where) for i in bucket])
            dist.broadcast(flat, src=_global_rank(src, group), group=group)
            offset = 0
            with torch.no_grad():
                for i in bucket:
                    target = group_tensors[i]
                    n = target.numel()
                    target.copy_(flat[offset : offset + n].view(target.shape))
                    offset += n


def _global_rank(group_rank: int, group: Any) -> int:
    if group is None:
        return group_rank
    import torch.distributed as dist

    return int(dist.get_global_rank(group, group_rank))


def max_all_reduce(
    values: torch.Tensor, *, group: Any = None, device: torch.device | None = None
) -> torch.Tensor:
    """MAX-all-reduce a small float64 vector (headers: per-rank slots, flags); return it on CPU."""
    import torch
    import torch.distributed as dist

    where = device if device is not None else values.device
    buffer = values.to(device=where, dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
    return buffer.cpu()


def fingerprint(tensors: Sequence[torch.Tensor]) -> tuple[float, float]:
    """Two float64 numbers that differ when any value differs (sum, weighted sum of squares).

    Identical replicas (same bits) give identical fingerprints; a changed element changes them
    except with negligible probability (the weights depend on the tensor and on the position
    of its 4M-element chunk, so moved values are noticed too). Computed chunk by chunk on each
    tensor's device, with one host synchronisation per device. Non-finite values give NaN/Inf.
    """
    import torch

    parts: dict[torch.device, list[torch.Tensor]] = {}
    for k, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        for j, chunk in enumerate(torch.split(flat, FINGERPRINT_CHUNK)):
            wide = chunk.to(torch.float64)
            weight = 1.0 + 1e-3 * k + 1e-7 * j
            pair = torch.stack([wide.sum(), (wide * wide).sum() * weight])
            parts.setdefault(pair.device, []).append(pair)
    if not parts:
        return 0.0, 0.0
    total = torch.stack([torch.stack(p).sum(dim=0).cpu() for p in parts.values()]).sum(dim=0)
    return float(total[0]), float(total[1])
