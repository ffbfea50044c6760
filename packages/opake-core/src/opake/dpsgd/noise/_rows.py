"""Parts of one :class:`~opake.dpsgd.noise.GaussianNoise` draw, without drawing the rest.

Implementation module behind :meth:`GaussianNoise.draw_rows`: what a rank of a sharded run
needs (the rows of the global noise its shard holds), bit for bit equal to slicing the noise
the full draw adds to zeros, each element drawn from its own keystream words only
(:meth:`~opake.dpsgd.randomness.Randomness.normal_range_pieces`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
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
        0-d entry has one row (``rows(name, 0, 1)`` is the 0-d tensor)."""
        import torch

        from opake.dpsgd.noise._gaussian import _snap_add_, noise_grid

        shape = self.shape(name)
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.float64):
            raise InputTypeError(f"dtype={dtype}: expected torch.float32 or torch.float64")
        length = shape[0] if shape else 1
        for bound in (start, stop):
            if isinstance(bound, bool) or not isinstance(bound, int):
                raise InputTypeError(f"row bound {bound!r}: expected an int")
        if not 0 <= start <= stop <= length:
            raise ConfigurationError(
                f"rows [{start}, {stop}) of {name!r}: expected 0 ≤ start ≤ stop ≤ {length}"
            )
        inner = math.prod(shape[1:])
        out_shape = (stop - start, *shape[1:]) if shape else (() if stop > start else (0,))
        out = torch.zeros(out_shape, dtype=dtype, device=device)
        if out.numel() == 0:
            return out
        flat = out.view(-1)
        first = self._offsets[name] + start * inner
        last = first + flat.numel()
        grid = noise_grid(self._std)
        pieces = self._source.normal_range_pieces(
            "noise", self._index, self._total, first, last, dtype=torch.float64,
            scale=self._std / grid,
        )  # fmt: skip
        for position, units in pieces:
            at = position - first
            # the same kernels as the full draw on a zero target (GaussianNoise.add)
            _snap_add_(flat[at : at + units.numel()], units, grid)
        return out

    def __repr__(self) -> str:
        return f"NoiseRows({len(self._shapes)} entries, {self._total} values, std={self._std})"
