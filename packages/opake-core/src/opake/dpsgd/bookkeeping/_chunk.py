"""What one microbatch leaves behind, and its clipped sum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.dpsgd.bookkeeping._certify import exact_add, full_precision
from opake.dpsgd.bookkeeping._rules import Piece, add_weighted

if TYPE_CHECKING:
    import torch

__all__ = ["BookkeepingChunk"]


@dataclass
class BookkeepingChunk:
    """What one microbatch leaves: losses, per-leaf squared norms and the pieces for the sum.

    ``leaf_sq`` are the computed squared norms (reported); ``clip_sq`` bound the squared norm
    of what each example adds to each leaf (clip with these, see :mod:`._bk_certify`);
    ``exact`` marks the (example, leaf) pairs that take the exact route; ``span`` is the scale
    of every fp32 rounding error in an example's leaf (``Σ_t ‖a_t‖‖b_t‖``).
    """

    loss: torch.Tensor
    leaf_sq: torch.Tensor  # [m, leaves] float64
    aux: Any
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    clip_sq: torch.Tensor | None = None  # [m, leaves] float64; None: leaf_sq
    exact: torch.Tensor | None = None  # [m, leaves] bool; None: no exact route
    span: torch.Tensor | None = None  # [m, leaves] float64 Σ_t ‖a_t‖‖b_t‖: the rounding scale

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
                if routed[j]:
                    assert exact is not None
                    mask = keep & ~exact[:, j]
                for piece in own:
                    add_weighted(piece, leaf_factor[:, j], mask, total)
                for i in routed[j]:
                    exact_add(own, i, leaf_factor[i, j], total)
                del own
