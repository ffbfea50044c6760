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

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, TypeGuard

from opake.dpsgd.clipping._grads import ClippedGrads
from opake.dpsgd.distributed._comm import broadcast_tensors
from opake.dpsgd.distributed._optim import _NoiseProxy
from opake.dpsgd.noise._checks import resolve_sensitivity
from opake.dpsgd.noise._gaussian import noise_grid

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


def _sum_copy(value: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous fp32 copy of ``value`` (this rank's part of it, for a ``DTensor``):
    the buffer the noise is snapped into."""
    import torch

    return _local(value).detach().to(torch.float32, copy=True).contiguous()


def _noised_rows(
    value: torch.Tensor,
    name: str,
    noise_into: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """``value`` (this rank's rows of the global clipped sum) noised, laid out like it.

    ``noise_into(dest, start)`` noises rows ``start...`` of entry ``name`` into ``dest`` in
    place, snapped onto the lattice with the sum itself (one rounding of ``x + noise``, as
    :meth:`GaussianNoise.add_ <opake.dpsgd.noise.GaussianNoise.add_>` does — never the noise
    alone added afterwards, whose fp32 addition would keep the cancellation holes of
    ``docs/guide/privacy-noise.md``). A dim-0 shard noises its own rows; a parameter FSDP
    does not shard noises the whole sum; any other layout gathers the parameter's sum (a
    collective), noises it whole and keeps this rank's part."""
    if _is_sharded(value):
        rows = _row_range(value)
        from torch.distributed.tensor import DTensor

        if rows is not None:
            local = noise_into(_sum_copy(value), rows[0])
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        full = value.full_tensor().detach().float().contiguous()
        return _like(noise_into(full, 0), value)
    return noise_into(_sum_copy(value), 0)


def _rows_into(draw: NoiseRows, name: str, dest: torch.Tensor, start: int) -> torch.Tensor:
    """``draw.add_rows_`` with the argument order :func:`_noised_rows` calls it with."""
    return draw.add_rows_(name, start, dest)


def _full_sum(value: torch.Tensor) -> torch.Tensor:
    """The whole global sum of one parameter, fp32, on every rank (gathered from the rows of
    a ``DTensor``: a collective)."""
    import torch

    whole = value.full_tensor() if _is_sharded(value) else value
    return whole.detach().to(torch.float32, copy=True).contiguous()


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
        """Rank 0's draw, one parameter's full-size noise at a time, broadcast in lattice units
        (fp64, before any rounding); each rank snaps its rows into its rows of the sum."""
        import torch
        import torch.distributed as dist

        from opake.dpsgd.noise._gaussian import _snap_add_

        names = list(grads)
        shapes = {n: grads[n].shape for n in names}
        draw = (
            self._inner.draw_rows(shapes, sensitivity) if dist.get_rank(self._group) == 0 else None
        )
        std = float(self._inner.noise_multiplier) * resolve_sensitivity({}, sensitivity)
        grid = noise_grid(std)  # NoiseRows.grid of rank 0's draw
        out: dict[str, torch.Tensor] = {}
        for name in names:
            value = grads[name]
            device = _local(value).device
            length = value.shape[0] if value.ndim else 1
            if draw is not None:
                units = draw.units(name, 0, length, device=device)
            else:
                units = torch.empty(value.shape, dtype=torch.float64, device=device)
            broadcast_tensors([units], src=0, group=self._group, device=self._device)

            def into(dest: torch.Tensor, start: int, units: torch.Tensor = units) -> torch.Tensor:
                rows = units[start : start + dest.shape[0]] if dest.ndim else units
                _snap_add_(dest, rows.clone(), grid)
                return dest

            out[name] = _noised_rows(value, name, into)
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
            # one parameter's rows at a time: no full-size noise, no full-size sum
            return {n: _noised_rows(grads[n], n, partial(_rows_into, draw, n)) for n in names}
        # another noise object adds its noise to the sums itself (however it rounds): the
        # global sums are gathered whole, noised once (rank 0's draw broadcast, or the same
        # draw on every rank), and each rank keeps its rows
        full = {n: _full_sum(grads[n]) for n in names}
        if self._broadcast:
            if dist.get_rank(self._group) == 0:
                out = self._inner.add(full, sensitivity=sensitivity)
                noised = [out[n].detach().to(torch.float32).contiguous() for n in names]
            else:
                noised = list(full.values())
            broadcast_tensors(noised, src=0, group=self._group, device=self._device)
        else:
            out = self._inner.add(full, sensitivity=sensitivity)
            noised = [out[n].detach().to(torch.float32).contiguous() for n in names]
        return {n: _like(v, grads[n]) for n, v in zip(names, noised, strict=True)}

    __call__ = add

    def __repr__(self) -> str:
        how = "rank 0's draw" if self._broadcast else "a shared-seed draw"
        return f"ShardedNoise({self._inner!r}, rows of {how})"
