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

from dataclasses import dataclass, field
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
    #: padded positions per expert (``start → (row index into [B·M], M)``), shareable by the
    #: weights of one call (same slots)
    layout: dict[int, tuple[torch.Tensor, int]] = field(
        default_factory=dict, compare=False, repr=False
    )

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

    def _rows(self) -> tuple[torch.Tensor, int]:
        """Row of every slot in an ``[E·B·M]`` padded layout (expert, example, position), and
        ``M``, the largest number of slots one example routes to one expert."""
        import torch

        if -1 not in self.layout:
            experts = torch.repeat_interleave(
                torch.arange(len(self.counts), device=self.example.device),
                torch.tensor(self.counts, device=self.example.device),
            )
            group = experts * self.batch + self.example  # sorted: expert-major, then example
            first = torch.searchsorted(group, group)  # the first slot of each group's run
            pos = torch.arange(group.shape[0], device=group.device) - first
            rows = int(pos.max()) + 1 if pos.numel() else 1
            self.layout[-1] = (group * rows + pos, rows)
        return self.layout[-1]

    def _padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots as ``[E·B, M, R]`` and ``[E·B, M, C]`` (zero rows pad each (expert,
        example) to ``M``)."""
        index, rows = self._rows()
        out = []
        for x in (self.a, self.b):
            padded = x.new_zeros(len(self.counts) * self.batch * rows, x.shape[-1])
            padded.index_copy_(0, index, x)
            out.append(padded.reshape(-1, rows, x.shape[-1]))
        return out[0], out[1]

    def sq_norms(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(‖G_i‖² [B] fp64, None)``: the Gram route over every (expert, example) at once,
        or expert by expert the materialised one, whichever :func:`ghost_is_cheaper` says."""
        import torch

        from opake.dpsgd.bookkeeping import ghost_is_cheaper

        experts, rows, cols = self.shape
        _, steps = self._rows()
        a, b = self._padded()
        if ghost_is_cheaper(steps, rows, cols):
            gram = torch.bmm(b, b.transpose(1, 2)).mul_(torch.bmm(a, a.transpose(1, 2)))
            per = gram.sum(dim=(1, 2), dtype=torch.float64).reshape(experts, self.batch)
            return per.sum(dim=0), None
        total = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
        for expert, _, _ in self._groups():  # one expert's [B, R, C] at a time
            mine = slice(expert * self.batch, (expert + 1) * self.batch)
            g = torch.bmm(a[mine].transpose(1, 2), b[mine]).reshape(self.batch, -1)
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
        scale = w[self.example][:, None]
        if a.shape[-1] < b.shape[-1]:  # scale the narrower factor
            a = a * scale
        else:
            b = b * scale
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
