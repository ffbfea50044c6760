"""One-piece Gram-route leaves: their certified bounds as one pure tensor function.

Most differentiated leaves of a transformer are one linear layer's weight: a single
:class:`~._pieces.OuterSum` piece on the Gram route. Past its two Gram matrices (matrix
products), its certificate and bounds are about a hundred elementwise operations on ``[B, T]``
and ``[B]`` tensors, each paying PyTorch's dispatch when run eagerly. :func:`leaf_arith`
evaluates them from the two Gram matrices and a vector of the leaf's constants (its shape and
dtypes enter only there, so one graph serves every leaf of one chunk shape), through the very
functions of the general route (:func:`~opake.dpsgd.certify.diagonal_from`,
:func:`~._certify.ghost_cert`, :func:`~._certify.finish`). :class:`LeafBoundsFn` applies it
to the leaves it covers and hands every other leaf to :func:`~._certify.leaf_bounds`;
``DPTraining(compile=True)`` runs it compiled.

Compiling stays inside the proof's model (the privacy guide's "Proof of the clipping bound"):
Inductor's C++ code evaluates the same IEEE-754 operations on the same fp64 values (no
fast-math, no floating-point contraction, fp64 constants), its reductions in another order
(every sum is bounded for any order), and the formulas' own rounding stays under ``SAFE``.
A leaf whose token norms come out non-finite (a Gram block that overflowed) goes to the
general route, which recomputes them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opake.dpsgd.bookkeeping._certify import LeafBounds, finish, ghost_cert, leaf_bounds
from opake.dpsgd.bookkeeping._pieces import OuterSum, Piece, ghost_is_cheaper, gram_a
from opake.dpsgd.certify import (
    ETA,
    GramCache,
    contraction_factors,
    diagonal_factors,
    diagonal_from,
    entry_error,
    gamma32,
    gram,
    ieee_compile_options,
    wide,
)

if TYPE_CHECKING:
    import torch

__all__ = ["LeafBoundsFn", "leaf_arith", "leaf_constants"]

_log = logging.getLogger("opake.core")


def leaf_constants(piece: OuterSum, numel: int) -> list[float]:
    """The constants :func:`leaf_arith` needs for ``piece`` (a leaf of ``numel`` entries): the
    two sides' :func:`~opake.dpsgd.certify.diagonal_factors`, the
    :func:`~opake.dpsgd.certify.contraction_factors`, the two sides'
    :func:`~opake.dpsgd.certify.entry_error` and ``ETA·√numel``.

    >>> import torch
    >>> len(leaf_constants(OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4)), 12))
    17
    """
    rows, cols = piece.shape
    batch, steps = int(piece.b.shape[0]), int(piece.b.shape[1])
    a, b = piece.a, piece.b
    return [
        *diagonal_factors(rows, a.dtype, wide(a)),
        *diagonal_factors(cols, b.dtype, wide(b)),
        *contraction_factors(steps=steps, rows=batch * steps, shape=(rows, cols)),
        *entry_error(rows, a.dtype, wide(a)),
        *entry_error(cols, b.dtype, wide(b)),
        ETA * math.sqrt(numel),
    ]


def leaf_arith(ga: torch.Tensor, gb: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A one-piece Gram-route leaf's ``(finite, sq, bound, slack, loose, rounding)`` from its
    Gram matrices ``ga = gram(a)``, ``gb = gram(b)`` ``[B, T, T]`` (fp64) and ``k`` =
    :func:`leaf_constants` (fp64 ``[17]``); ``finite``: whether every token-norm bound is
    finite (where not, the caller takes the general route).

    >>> import torch
    >>> piece = OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    >>> k = torch.tensor(leaf_constants(piece, 12), dtype=torch.float64)
    >>> out = leaf_arith(gram(piece.a), gram(piece.b), k)
    >>> bool(out[0]), float(out[1][0]), 48.0**0.5 <= float(out[2][0]) < 48.0**0.5 + 1e-4
    (True, 48.0, True)
    """
    import torch

    c = k.unbind()
    alpha = diagonal_from(ga, (c[0], c[1], c[2], c[3]))
    beta = diagonal_from(gb, (c[4], c[5], c[6], c[7]))
    sq, err, rel, abs_, sums = ghost_cert(
        ga,
        gb,
        alpha,
        beta,
        factors=(c[8], c[9], c[10], c[11]),
        a_err=(c[12], c[13]),
        b_err=(c[14], c[15]),
    )
    rounding = gamma32(int(gb.shape[1]) + 2) * sums[0]
    out = finish(sq, err, rel, abs_, tail=c[16], rounding=rounding)
    finite = torch.isfinite(alpha).all() & torch.isfinite(beta).all()
    return finite, out.sq, out.bound, out.slack, out.loose, out.rounding


def _covered(pieces: Sequence[Piece]) -> OuterSum | None:
    """The leaf's piece when it is one OuterSum on the Gram route, else ``None``."""
    if len(pieces) != 1 or not isinstance(pieces[0], OuterSum) or pieces[0].indexed:
        return None
    piece = pieces[0]
    rows, cols = piece.shape
    return piece if ghost_is_cheaper(int(piece.b.shape[1]), rows, cols) else None


class LeafBoundsFn:
    """:func:`~._certify.leaf_bounds` with one-piece Gram-route leaves through
    :func:`leaf_arith`, compiled (``compiled=True``: ``torch.compile``, one graph per chunk
    shape) or eager. A compiled call that fails (Dynamo's recompile limit, say) turns the
    compilation off for good, logged on ``opake.core``.

    >>> import torch
    >>> piece = OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    >>> float(LeafBoundsFn()([piece], 12, GramCache()).sq[0])
    48.0
    """

    def __init__(self, *, compiled: bool = False) -> None:
        self._fn: Callable[..., tuple[torch.Tensor, ...]] = leaf_arith
        if compiled:
            import torch

            self._fn = torch.compile(
                leaf_arith, dynamic=False, fullgraph=True, options=ieee_compile_options()
            )
        self.compiled = compiled
        self._constants: dict[tuple[Any, ...], torch.Tensor] = {}

    def _k(self, piece: OuterSum, numel: int) -> torch.Tensor:
        import torch

        a, b = piece.a, piece.b
        key = (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, numel, b.device)
        k = self._constants.get(key)
        if k is None:
            if len(self._constants) >= 64:
                self._constants.clear()
            k = torch.tensor(leaf_constants(piece, numel), dtype=torch.float64, device=b.device)
            self._constants[key] = k
        return k

    def _run(self, ga: torch.Tensor, gb: torch.Tensor, k: torch.Tensor) -> tuple[Any, ...]:
        if not self.compiled:
            return leaf_arith(ga, gb, k)
        try:
            return self._fn(ga, gb, k)
        except Exception as err:  # any compile failure: the eager arithmetic
            _log.warning(
                "book-keeping: the compiled bound arithmetic failed (%s); computing bounds "
                "eagerly from now on",
                str(err).splitlines()[0] if str(err) else type(err).__name__,
            )
            self._fn, self.compiled = leaf_arith, False
            return leaf_arith(ga, gb, k)

    def __call__(
        self, pieces: Sequence[Piece], numel: int, cache: GramCache | None = None
    ) -> LeafBounds:
        """The leaf's :class:`~._certify.LeafBounds` (pieces of Opake's rules: trusted)."""
        piece = _covered(pieces)
        if piece is not None:
            gb = gram(piece.b) if cache is None else cache.gram(piece.b)
            ga = gram_a(piece, piece)
            finite, sq, bound, slack, loose, rounding = self._run(ga, gb, self._k(piece, numel))
            if bool(finite):
                return LeafBounds(sq, bound, slack, loose, rounding)
        return leaf_bounds(pieces, numel, cache, trusted=True)
