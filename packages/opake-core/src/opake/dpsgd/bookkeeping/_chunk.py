"""What one microbatch leaves behind, and its clipped sum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.dpsgd.bookkeeping._certify import exact_block
from opake.dpsgd.bookkeeping._pieces import Piece, add_weighted
from opake.dpsgd.certify import full_precision, guarded_add

if TYPE_CHECKING:
    import torch

__all__ = ["BookkeepingChunk"]


@dataclass
class BookkeepingChunk:
    """What one microbatch leaves: losses, per-leaf squared norms and the pieces for the sum.

    ``leaf_sq`` are the computed squared norms (reported); ``clip_sq`` the squared certified
    bounds to clip with and ``slack`` the part of each added tensor's error that does not scale
    with the clip factor (see :mod:`._certify`): ``‖added_ij‖ ≤ w·√clip_sq_ij + slack_ij``;
    ``exact`` marks the (example, leaf) pairs that take the exact route, ``parts`` their
    measured blocks' certified squared norms (the guard of the add).
    """

    loss: torch.Tensor
    leaf_sq: torch.Tensor  # [m, leaves] float64
    aux: Any
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    clip_sq: torch.Tensor | None = None  # [m, leaves] float64; None: leaf_sq
    exact: torch.Tensor | None = None  # [m, leaves] bool; None: no exact route
    slack: torch.Tensor | None = None  # [m, leaves] float64
    parts: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    rounding: torch.Tensor | None = None  # [m, leaves] float64, see LeafBounds.rounding

    def accumulate(
        self,
        names: tuple[str, ...],
        leaf_factor: torch.Tensor,
        keep: torch.Tensor,
        sums: Mapping[str, torch.Tensor],
    ) -> None:
        """``sums[name] += Σ_i leaf_factor[i, j] G_i`` for each leaf ``j``, in place (fp32).

        Each leaf's pieces are released as soon as its sum is done (the recorded inputs and
        output gradients of a layer are freed while the next layer's sum runs), so the chunk
        can be accumulated once. The leaves go in reverse order: the last layers' recorded
        tensors are freed first, and the first parameters — an embedding tied to the output
        head, whose kept logit gradients and weighted sum are the largest — come last, when
        every other layer's are gone (each leaf's sum is its own: the order changes no value).
        """
        exact = self.exact
        routed: list[list[int]] = [[] for _ in names]
        if exact is not None:
            for i, j in (exact & keep[:, None]).nonzero().tolist():
                routed[j].append(i)
        everything = bool(keep.all())  # one host sync; skips the masking copies
        with full_precision():
            for j in reversed(range(len(names))):
                name = names[j]
                total = sums[name]
                own = self.pieces.pop(name, [])
                mask = None if everything and not routed[j] else keep
                if exact is not None and routed[j]:
                    mask = keep & ~exact[:, j]
                for piece in own:
                    add_weighted(piece, leaf_factor[:, j], mask, total)
                for i in routed[j]:

                    def block(
                        start: int, stop: int, i: int = i, own: list[Piece] = own
                    ) -> torch.Tensor:
                        return exact_block(own, i, start, stop)

                    guarded_add(block, leaf_factor[i, j], total, self.parts[(i, j)])
                del own
