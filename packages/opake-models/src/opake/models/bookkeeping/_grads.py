"""Per-example gradients of a fused expert weight ``W [E, R, C]``, never materialised for all.

Token ``t`` of example ``i`` routed to expert ``e`` (one *slot* per (token, top-k position))
adds the outer product ``a_s b_sᵀ`` to block ``e`` of example ``i``'s gradient:
``G_ie = Σ_{s ∈ S_ie} a_s b_sᵀ``. So per example

``‖G_i‖² = Σ_e ‖G_ie‖² = Σ_e Σ_{s, s' ∈ S_ie} (a_s·a_s')(b_s·b_s')``

— the ghost identity restricted to pairs of slots routed to the same expert — or, where an
expert sees many of the example's slots (``|S_ie|·(R + C) > R·C``, the linear layers'
crossover), ``G_ie`` itself. The clipped sum ``Σ_i w_i G_i`` is one ``[R, C]`` matmul per
expert over its slots, the rows scaled by their example's factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

__all__ = ["ExpertGrads"]


@dataclass(frozen=True)
class ExpertGrads:
    """Per-example gradients of a fused expert weight held as routed slots (an ``ImplicitGrad``).

    ``a [N, R]`` and ``b [N, C]`` are the slots' factors (fp32), sorted by expert (``counts[e]``
    slots for expert ``e``, in that order), and within an expert by example (``example [N]``).
    The engine sees a parameter of shape ``(E, R, C)``.

    >>> import torch
    >>> a, b = torch.tensor([[1.0], [1.0], [2.0]]), torch.tensor([[1.0], [-1.0], [3.0]])
    >>> g = ExpertGrads(a, b, torch.tensor([0, 0, 0]), (2, 1), batch=1)
    >>> g.sq_norms()[0].tolist()  # expert 0: 1 - 1 = 0; expert 1: 6
    [36.0]
    >>> g.weighted_sum(torch.tensor([0.5]))[0].tolist()
    [[[0.0]], [[3.0]]]
    """

    a: torch.Tensor
    b: torch.Tensor
    example: torch.Tensor
    counts: tuple[int, ...]
    batch: int

    @property
    def shape(self) -> tuple[int, ...]:
        """``(E, R, C)``."""
        return len(self.counts), int(self.a.shape[-1]), int(self.b.shape[-1])

    def _groups(self) -> list[tuple[int, int, int]]:
        """``(expert, start, stop)`` of every expert with at least one slot."""
        out, start = [], 0
        for expert, count in enumerate(self.counts):
            if count:
                out.append((expert, start, start + count))
            start += count
        return out

    def _padded(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's slots as ``[B, M, R]`` and ``[B, M, C]`` (zero rows pad each example to
        the expert's largest count ``M``)."""
        import torch

        ex = self.example[start:stop]
        first = torch.searchsorted(ex, ex)  # sorted: the first slot of each example's run
        pos = torch.arange(stop - start, device=ex.device) - first
        rows = int(pos.max()) + 1
        a = self.a.new_zeros(self.batch, rows, self.a.shape[-1])
        b = self.b.new_zeros(self.batch, rows, self.b.shape[-1])
        a[ex, pos] = self.a[start:stop]
        b[ex, pos] = self.b[start:stop]
        return a, b

    def sq_norms(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(‖G_i‖² [B] fp64, None)``: per expert the Gram or the materialised route."""
        import torch

        from opake.dpsgd.bookkeeping import ghost_is_cheaper

        total = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
        _, rows, cols = self.shape
        for _, start, stop in self._groups():
            a, b = self._padded(start, stop)
            if ghost_is_cheaper(int(a.shape[1]), rows, cols):
                gram = torch.bmm(b, b.transpose(1, 2)).mul_(torch.bmm(a, a.transpose(1, 2)))
                total += gram.sum(dim=(1, 2), dtype=torch.float64)
            else:
                g = torch.bmm(a.transpose(1, 2), b).reshape(self.batch, -1)
                total += (g * g).sum(dim=1, dtype=torch.float64)
        return total, None

    def weighted_sum(
        self, weights: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Σ_i w_i G_i [E, R, C] fp32, None)``; examples not kept add exactly zero."""
        import torch

        w = weights.float()
        a, b = self.a, self.b
        if keep is not None:
            w = torch.where(keep, w, 0.0)
            kept = keep[self.example][:, None]
            a, b = torch.where(kept, a, 0.0), torch.where(kept, b, 0.0)
        b = b * w[self.example][:, None]
        out = a.new_zeros(self.shape)
        for expert, start, stop in self._groups():
            out[expert] = a[start:stop].T @ b[start:stop]
        return out, None

    def inner_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """No cross term: a fused expert weight is read by its experts layer only."""
        raise OperationError(
            "book-keeping: a fused expert weight is also used by another layer; no rule forms "
            "that cross term. Use clipped_grad(method='vmap')"
        )

    def abs_norms(self) -> torch.Tensor:
        """``Σ_s ‖a_s‖ ‖b_s‖`` per example ``[B]`` (fp64): a bound of ``‖G_i‖`` that no
        cancellation between slots shrinks."""
        import torch

        terms = torch.linalg.vector_norm(self.a, dim=1).double()
        terms = terms * torch.linalg.vector_norm(self.b, dim=1).double()
        out = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
        return out.index_add_(0, self.example, terms)

    def example_rows(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Experts ``start:stop`` of example ``index``'s gradient, fp64 ``[stop-start, R·C]``
        (fp32 products are exact in fp64; the same sums in the same order on every call)."""
        import torch

        _, rows, cols = self.shape
        out = torch.zeros(stop - start, rows, cols, dtype=torch.float64, device=self.a.device)
        for expert, lo, hi in self._groups():
            if start <= expert < stop:
                mine = self.example[lo:hi] == index
                a, b = self.a[lo:hi][mine].double(), self.b[lo:hi][mine].double()
                out[expert - start] = a.T @ b
        return out.reshape(stop - start, rows * cols)
