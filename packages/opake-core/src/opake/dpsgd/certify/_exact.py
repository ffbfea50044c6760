"""The exact route: measure a materialised gradient, then add exactly what was measured.

An example whose certified Gram-route bound is loose (strong cancellation between its tokens,
underflow) gets its gradient materialised block by block (each block computed in fp64 from the
recorded fp32 factors, then rounded to fp32), measured, and added with its clip factor. The
blocks are computed twice (to measure, then to add) because keeping a whole parameter-sized
gradient per example would cost its memory; nothing in the assumptions makes the two
computations round alike (a BLAS may pick another order, a kernel recomputes logits), so the
add pass **guards** each block: a block whose certified norm exceeds the one measured for it
is scaled down to it before it is added. Then ``‖added‖ ≤ (1 + u)·w·√(Σ_k ν_k²)`` where ``ν_k``
are the measured blocks' certified norms, whatever the second computation returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from opake.dpsgd.certify._float import SAFE, dense_sq_norms

if TYPE_CHECKING:
    import torch

__all__ = ["ROW_BLOCK", "guarded_add", "measure_blocks", "row_blocks"]

ROW_BLOCK = 1 << 22  #: entries of one materialised block of the exact route

#: ``block(start, stop) -> fp32 [stop - start, cols]``: rows of one example's gradient
BlockFn = Callable[[int, int], "torch.Tensor"]


def row_blocks(shape: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` row ranges of a parameter of ``shape`` viewed as ``[rows, cols]``.

    >>> list(row_blocks((3, 2)))
    [(0, 3)]
    """
    rows = int(shape[0]) if len(shape) else 1
    cols = 1
    for n in shape[1:]:
        cols *= int(n)
    step = max(1, ROW_BLOCK // max(1, cols))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def measure_blocks(
    block: BlockFn, shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """``(computed ‖Ĝ‖², certified bound of ‖Ĝ‖², each block's certified squared norm)`` of the
    fp32 gradient the ``block`` function builds (fp64 0-d tensors, and a list).

    >>> import torch
    >>> hat, up, parts = measure_blocks(lambda a, b: torch.ones(b - a, 2), (3, 2))
    >>> round(float(hat), 5), len(parts), parts[0] >= 6.0
    (6.0, 1, True)
    """
    import torch

    hat = torch.zeros((), dtype=torch.float64)
    parts: list[float] = []
    for start, stop in row_blocks(shape):
        rows = block(start, stop)
        h, u = dense_sq_norms(rows.reshape(1, -1))
        hat = hat + h[0].cpu()
        parts.append(float(u[0]))
    total = sum(parts) * (1.0 + SAFE)
    return hat, torch.tensor(total, dtype=torch.float64), parts


def guarded_add(
    block: BlockFn, factor: torch.Tensor, out: torch.Tensor, parts: Sequence[float]
) -> int:
    """``out += factor · Ĝ`` block by block, each block scaled down to its measured certified
    norm ``parts[k]`` if its recomputation came out larger; returns how many blocks were.

    >>> import torch
    >>> out = torch.zeros(3, 2)
    >>> guarded_add(lambda a, b: torch.full((b - a, 2), 2.0), torch.tensor(1.0), out, [6.0])
    1
    >>> bool(out.square().sum() <= 6.0)
    True
    """
    import torch

    flat = out.view(out.shape[0] if out.dim() else 1, -1)
    scaled = 0
    for k, (start, stop) in enumerate(row_blocks(tuple(out.shape))):
        rows = block(start, stop)
        _, up = dense_sq_norms(rows.reshape(1, -1))
        limit = parts[k]
        if not float(up[0]) <= limit:  # recomputed larger (or not finite): scale it down
            scaled += 1
            ratio = (limit / float(up[0])) ** 0.5 * (1.0 - 2.0**-20) if limit > 0 else 0.0
            ratio = ratio if math.isfinite(ratio) else 0.0  # a non-finite block: drop it
            scale = torch.tensor(ratio, dtype=torch.float32)
            if float(scale) > ratio:  # round toward zero
                scale = torch.nextafter(scale, torch.zeros_like(scale))
            rows = torch.nan_to_num(rows, 0.0, 0.0, 0.0) * scale.to(rows.device)
        flat[start:stop].add_(rows * factor.to(rows.dtype))
    return scaled
