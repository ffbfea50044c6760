"""Each rank's rows under FSDP2: the clipped sums reduced to them, the noise drawn for them.

:class:`~opake.dpsgd.distributed.ShardedDPOptimizer` (levels 1 and 2) and level 2's ``grad_fn``
(:mod:`opake.dpsgd.distributed.sharded`) share these pieces:

- :func:`reduce_rows` — the SUM over the ranks of a full-size fp32 sum, laid out like the
  parameter: its rows on this rank (a reduce-scatter of a ``Partial`` ``DTensor``), or the
  whole sum for a parameter FSDP does not shard (an all-reduce);
- :class:`ScatteredGrads` — what a ``grad_fn(..., reduce_scatter=True)`` call returns: this
  rank's rows of the global clipped sum, already reduced;
- :class:`_ShardedNoise` — each rank adds its rows of one full-size Gaussian draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from opake.dpsgd.clipping._grads import ClippedGrads
from opake.dpsgd.distributed._comm import broadcast_tensors
from opake.dpsgd.distributed._optim import _NoiseProxy

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from opake.dpsgd.noise._rows import NoiseRows

__all__ = ["ScatteredGrads", "reduce_rows"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def _is_sharded(tensor: object) -> TypeGuard[DTensor]:
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (the tensor itself when it is not sharded)."""
    return tensor.to_local() if _is_sharded(tensor) else tensor


def reduce_rows(
    full: torch.Tensor, like: torch.Tensor, *, group: Any, device: torch.device
) -> torch.Tensor:
    """The SUM over the ranks of ``full`` (fp32, the full shape on every rank), laid out like
    ``like``: this rank's rows of a ``DTensor`` parameter (reduce-scatter), else the whole sum
    (all-reduce through ``device``, the group's communication device). A collective: every
    rank calls it for the same parameters in the same order."""
    import torch.distributed as dist

    if not _is_sharded(like):
        buffer = full.to(device).clone()
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        return buffer.to(full.device)
    from torch.distributed.tensor import DTensor, Partial

    mesh = like.device_mesh
    partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, like.placements)


class ScatteredGrads(ClippedGrads):
    """This rank's rows of the *global* clipped sum, reduced (SUM, fp32) over the ranks.

    Returned by a level-2 ``grad_fn(..., reduce_scatter=True)`` call, the only physical batch
    of its logical step: each value is laid out like its parameter (a ``DTensor`` shard, or
    the whole sum of a parameter FSDP does not shard). ``max_norm`` is the sensitivity of the
    global sum, ``batch_size`` this rank's count of real examples. Only
    :meth:`ShardedDPOptimizer.accumulate
    <opake.dpsgd.distributed.ShardedDPOptimizer.accumulate>` takes it, as the step's only
    physical batch: it is not reduced again, and it cannot be added to another result.
    """

    def __repr__(self) -> str:
        return f"ScatteredGrads({len(self)} shards, max_norm={self.max_norm!r})"


def _like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (identical on every rank) laid out like ``like``: its rows on this rank."""
    if not _is_sharded(like):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def _row_range(value: DTensor) -> tuple[int, int] | None:
    """The global rows ``[start, stop)`` this rank's local part of ``value`` holds, when it is
    sharded on dim 0 alone (FSDP2's layout); ``None`` for any other layout."""
    from torch.distributed.tensor import Shard

    try:  # DTensor's own layout arithmetic (a private helper: without it, the full draw)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - a PyTorch that moved it
        return None
    placements = tuple(value.placements)
    if value.ndim == 0 or placements != (Shard(0),) or type(placements[0]) is not Shard:
        return None
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, placements
    )
    if tuple(value.to_local().shape) != tuple(shape):
        return None
    start = int(offset[0]) if shape[0] else 0
    return start, start + int(shape[0])


def _rows_of(draw: NoiseRows, name: str, value: torch.Tensor) -> torch.Tensor:
    """The noise of ``value``'s elements on this rank, laid out like ``value``: only its own
    rows are drawn (dim-0 shards), else the parameter's full noise, redistributed."""
    if _is_sharded(value):
        rows = _row_range(value)
        if rows is not None:
            from torch.distributed.tensor import DTensor

            local = draw.rows(name, *rows, device=value.to_local().device)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
    full = draw.rows(name, 0, value.shape[0] if value.ndim else 1, device=_local(value).device)
    return _like(full, value)


class _ShardedNoise(_NoiseProxy):
    """One full-size draw (shared seed, or rank 0's broadcast), each rank adding its rows.

    With a :class:`~opake.dpsgd.noise.GaussianNoise` (its own ``add``) the draw is never
    materialised at once (:meth:`GaussianNoise.draw_rows`, bit for bit the full draw): with a
    shared key each rank generates only its rows, parameter by parameter; in broadcast mode
    rank 0 draws and broadcasts one parameter's full-size noise at a time. Other noise objects
    are drawn full-size, all parameters at once, as before."""

    def __init__(self, inner: Any, *, broadcast: bool, group: Any, device: torch.device) -> None:
        super().__init__(inner, group=group, device=device)
        self._broadcast = broadcast

    def _draws_rows(self) -> bool:
        """Whether the inner object is a GaussianNoise drawing as the class does (the same on
        every rank: the ranks agreed on their configuration)."""
        from opake.dpsgd.noise import GaussianNoise

        inner = self._inner
        return (
            isinstance(inner, GaussianNoise)
            and type(inner).add is GaussianNoise.add
            and type(inner).draw_rows is GaussianNoise.draw_rows
        )

    def _broadcast_by_parameter(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None
    ) -> dict[str, torch.Tensor]:
        """Rank 0's draw, one parameter's full-size noise at a time, broadcast; rows kept."""
        import torch
        import torch.distributed as dist

        names = list(grads)
        draw = None
        if dist.get_rank(self._group) == 0:
            draw = self._inner.draw_rows({n: grads[n].shape for n in names}, sensitivity)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            value = grads[name]
            device = _local(value).device
            if draw is not None:
                noise = draw.rows(name, 0, value.shape[0] if value.ndim else 1, device=device)
            else:
                noise = torch.zeros(value.shape, dtype=torch.float32, device=device)
            broadcast_tensors([noise], src=0, group=self._group, device=self._device)
            out[name] = value.to(torch.float32) + _like(noise, value)
        return out

    def add(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> dict[str, torch.Tensor]:
        import torch
        import torch.distributed as dist

        names = list(grads)
        if self._draws_rows():
            if sensitivity is None:
                sensitivity = getattr(grads, "max_norm", None)
            if self._broadcast:
                return self._broadcast_by_parameter(grads, sensitivity)
            draw = self._inner.draw_rows({n: grads[n].shape for n in names}, sensitivity)
            # one parameter's rows at a time: no full-size noise, no full-size zeros
            return {n: grads[n].to(torch.float32) + _rows_of(draw, n, grads[n]) for n in names}
        zeros = {
            n: torch.zeros(grads[n].shape, dtype=torch.float32, device=_local(grads[n]).device)
            for n in names
        }
        if self._broadcast:
            if dist.get_rank(self._group) == 0:
                out = self._inner.add(zeros, sensitivity=sensitivity)
                noise = [out[n].to(torch.float32) for n in names]
            else:
                noise = list(zeros.values())
            broadcast_tensors(noise, src=0, group=self._group, device=self._device)
        else:
            out = self._inner.add(zeros, sensitivity=sensitivity)
            noise = [out[n].to(torch.float32) for n in names]
        return {
            n: grads[n].to(torch.float32) + _like(z, grads[n])
            for n, z in zip(names, noise, strict=True)
        }

    __call__ = add

    def __repr__(self) -> str:
        how = "rank 0's draw" if self._broadcast else "a shared-seed draw"
        return f"ShardedNoise({self._inner!r}, rows of {how})"
