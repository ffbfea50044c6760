"""Parts of one :class:`~opake.dpsgd.noise.GaussianNoise` draw, without drawing the rest.

Implementation module behind :meth:`GaussianNoise.draw_rows`: what a rank of a sharded run
needs (the rows of the global noise its shard holds), bit for bit equal to slicing the noise
the full draw adds to zeros, each element drawn from its own keystream words only
(:meth:`~opake.dpsgd.randomness.Randomness.normal_range_pieces`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.randomness import Randomness

__all__ = ["NoiseRows"]


class NoiseRows:
    """The noise of one :class:`~opake.dpsgd.noise.GaussianNoise` call on zero tensors of the
    given shapes, handed out a row range of one entry at a time.

    ``rows(name, start, stop)`` equals ``noise.add(zeros)[name][start:stop]`` of the same
    call, bit for bit (fp32 zeros; fp64 with ``dtype=torch.float64``): the entries are laid
    end to end in sorted-name order, as :meth:`GaussianNoise.add` lays them, and only the
    requested elements are generated. Built by :meth:`GaussianNoise.draw_rows`, which counts
    the call once however many ranges are asked for.
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        *,
        std: float,
        source: Randomness,
        index: int,
    ) -> None:
        names = sorted(shapes)
        self._shapes = {name: tuple(int(d) for d in shapes[name]) for name in names}
        sizes = [math.prod(self._shapes[name]) for name in names]
        starts = itertools.accumulate(sizes, initial=0)
        self._offsets = dict(zip(names, starts, strict=False))
        self._total = sum(sizes)
        self._std = std
        self._source = source
        self._index = index

    @property
    def noise_std(self) -> float:
        """σ·S of the draw."""
        return self._std

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of entry ``name``."""
        if name not in self._shapes:
            raise ConfigurationError(f"no entry {name!r} in this draw: {', '.join(self._shapes)}")
        return self._shapes[name]

    @property
    def grid(self) -> float:
        """Λ, the lattice the noised values lie on (:func:`~opake.dpsgd.noise.noise_grid`)."""
        from opake.dpsgd.noise._gaussian import noise_grid

        return noise_grid(self._std)

    def rows(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` (dim 0) of entry ``name``'s noise, a fresh tensor of shape
        ``(stop - start, *shape[1:])`` on ``device``, fp32 unless ``dtype=torch.float64``; a
        0-d entry has one row (``rows(name, 0, 1)`` is the 0-d tensor). This is the noise
        *alone*: to release a noised sum, use :meth:`add_rows_` on the sum itself (adding
        these values to it in floating point would bring back the cancellation holes that
        ``docs/guide/privacy-noise.md`` describes)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.float64):
            raise InputTypeError(f"dtype={dtype}: expected torch.float32 or torch.float64")
        out = torch.zeros(self._row_shape(name, start, stop), dtype=dtype, device=device)
        return self.add_rows_(name, start, out)

    def add_rows_(self, name: str, start: int, dest: torch.Tensor) -> torch.Tensor:
        """Noise rows ``start...`` of entry ``name`` into ``dest`` (their clipped sum, a
        contiguous fp32 or fp64 tensor of ``k`` rows: rows ``[start, start + k)``), in place,
        exactly as :meth:`GaussianNoise.add_ <opake.dpsgd.noise.GaussianNoise.add_>` noises
        them: ``dest ← Λ·rint(fl64(dest/Λ + b))``, ``b`` the noise in lattice units, one
        rounding to ``dest``'s dtype. Returns ``dest``.

        >>> import torch
        >>> from opake.dpsgd.noise import GaussianNoise
        >>> x = torch.linspace(-1, 1, 6).reshape(3, 2)
        >>> full = GaussianNoise(1.0, seed=0).add({"w": x}, 1.0)["w"]
        >>> rows = GaussianNoise(1.0, seed=0).draw_rows({"w": (3, 2)}, 1.0)
        >>> torch.equal(rows.add_rows_("w", 1, x[1:].clone()), full[1:])
        True
        """
        import torch

        from opake.dpsgd.noise._gaussian import _snap_add_

        if not isinstance(dest, torch.Tensor):
            raise InputTypeError(f"dest={type(dest).__name__}: expected a torch.Tensor")
        if dest.dtype not in (torch.float32, torch.float64) or not dest.is_contiguous():
            raise InputTypeError(
                f"dest: a {'contiguous' if dest.is_contiguous() else 'non-contiguous'} "
                f"{dest.dtype} tensor; expected a contiguous fp32 or fp64 tensor"
            )
        shape = self.shape(name)
        rows = (dest.shape[0] if dest.ndim else 1) if shape else (1 if dest.numel() else 0)
        if tuple(dest.shape) != self._row_shape(name, start, start + rows):
            raise ConfigurationError(
                f"dest of shape {tuple(dest.shape)} for rows from {start} of {name!r} "
                f"{shape}: expected rows of shape {shape[1:]}"
            )
        flat, grid = dest.view(-1), self.grid
        for at, units in self._pieces(name, start, flat.numel()):
            # the kernels of the full draw (GaussianNoise.add_): one rounding of x + noise
            _snap_add_(flat[at : at + units.numel()], units, grid)
        return dest

    def units(
        self, name: str, start: int, stop: int, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` of entry ``name``'s noise in lattice units (fp64, before any
        rounding: the ``b`` that :meth:`add_rows_` adds), for a caller that sends them to
        other ranks, each snapping its rows into its own sum with ``Λ·rint(fl64(x/Λ + b))``."""
        import torch

        out = torch.empty(self._row_shape(name, start, stop), dtype=torch.float64)
        flat = out.view(-1)
        for at, units in self._pieces(name, start, flat.numel()):
            flat[at : at + units.numel()] = units
        return out.to(device) if device is not None else out

    def _pieces(self, name: str, start: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset, b)`` pieces of the ``count`` values from row ``start`` of ``name``:
        fp64 noise in lattice units, ``offset`` counted from the first of them."""
        import torch

        first = self._offsets[name] + start * math.prod(self.shape(name)[1:])
        pieces = self._source.normal_range_pieces(
            "noise", self._index, self._total, first, first + count,
            dtype=torch.float64, scale=self._std / self.grid,
        )  # fmt: skip
        for position, units in pieces:
            yield position - first, units

    def _row_shape(self, name: str, start: int, stop: int) -> tuple[int, ...]:
        """The shape of rows ``[start, stop)`` of entry ``name`` (bounds checked)."""
        shape = self.shape(name)
        length = shape[0] if shape else 1
        for bound in (start, stop):
            if isinstance(bound, bool) or not isinstance(bound, int):
                raise InputTypeError(f"row bound {bound!r}: expected an int")
        if not 0 <= start <= stop <= length:
            raise ConfigurationError(
                f"rows [{start}, {stop}) of {name!r}: expected 0 ≤ start ≤ stop ≤ {length}"
            )
        if not shape:
            return () if stop > start else (0,)
        return (stop - start, *shape[1:])

    def __repr__(self) -> str:
        return f"NoiseRows({len(self._shapes)} entries, {self._total} values, std={self._std})"
