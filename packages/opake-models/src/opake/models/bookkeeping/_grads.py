"""Per-example gradients of a fused expert weight ``W [E, R, C]``, never materialised for all.

Token ``t`` of example ``i`` routed to expert ``e`` (one *slot* per (token, top-k position))
adds the outer product ``a_s b_sᵀ`` to block ``e`` of example ``i``'s gradient:
``G_ie = Σ_{s ∈ S_ie} a_s b_sᵀ``. So per example

``‖G_i‖² = Σ_e ‖G_ie‖² = Σ_e Σ_{s, s' ∈ S_ie} (a_s·a_s')(b_s·b_s')``

— the ghost identity restricted to pairs of slots routed to the same expert — or, where an
example sends many slots to one expert (``|S_ie|·(R + C) > R·C``, the linear layers'
crossover), ``G_ie`` itself. The (expert, example) groups are padded in a few buckets of
similar sizes, each bucket taking the cheaper route for its size. The clipped sum
``Σ_i w_i G_i`` is an ``[R, C]`` matmul per expert over its slots, the rows scaled by their
example's factor (all experts in one grouped matmul where torch's CPU kernel takes the operands).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping import PieceCert

__all__ = ["BUCKETS", "ExpertGrads", "SlotLayout", "grouped_mm_takes"]

#: (expert, example) groups are padded in at most this many buckets of similar sizes: with
#: groups of up to 64 slots each bucket is a multiple of 8 (Qwen3-MoE-style test model, sizes up
#: to 42: norms 29 → 19 ms at 1 thread against 4 buckets of multiples of 16)
BUCKETS = 8


#: dtypes ``torch.nn.functional.grouped_mm`` takes on the CPU
_GROUPED_DTYPES = ("float32", "bfloat16", "float16")


def grouped_mm_takes(*operands: torch.Tensor, cols: int) -> bool:
    """Whether torch's CPU ``grouped_mm`` takes these operands (one dtype it has a kernel for,
    each row- or column-major with every other stride a multiple of 16 bytes, data 16-byte
    aligned) and an output of ``cols`` columns (rows of a multiple of 16 bytes).

    >>> import torch
    >>> grouped_mm_takes(torch.ones(5, 8), torch.ones(2, 8, 4), cols=4)
    True
    >>> grouped_mm_takes(torch.ones(5, 8).double(), torch.ones(2, 8, 4).double(), cols=4)
    False
    """
    import torch

    first = operands[0]
    if not hasattr(torch.nn.functional, "grouped_mm") or first.device.type != "cpu":
        return False
    if str(first.dtype).removeprefix("torch.") not in _GROUPED_DTYPES:
        return False
    size = first.element_size()
    for t in operands:
        if t.dtype != first.dtype or t.device != first.device or 1 not in t.stride()[-2:]:
            return False
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return (cols * size) % 16 == 0


@dataclass
class SlotLayout:
    """The padded layouts of one call's routed slots, computed once and shared by the
    :class:`ExpertGrads` of the weights of that call (the same slots)."""

    #: each slot's group ``expert·B + example`` and its position within the group
    positions: tuple[torch.Tensor, torch.Tensor] | None = None
    #: each slot's row in the padded buffer, and per bucket (first row, groups, padded size,
    #: the groups' ids)
    buckets: tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]] | None = None
    #: the slot of each padded row, and the padding rows to zero
    gather: tuple[torch.Tensor, torch.Tensor] | None = None


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
    #: padded layouts of the slots, shareable by the weights of one call (same slots)
    layout: SlotLayout = field(default_factory=SlotLayout, compare=False, repr=False)
    #: results of this weight kept for a later call (its norms and their error bounds)
    cache: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

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

    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's group ``expert·B + example`` and its position within the group."""
        import torch

        if self.layout.positions is None:
            experts = torch.repeat_interleave(
                torch.arange(len(self.counts), device=self.example.device),
                torch.tensor(self.counts, device=self.example.device),
            )
            group = experts * self.batch + self.example  # sorted: expert-major, then example
            first = torch.searchsorted(group, group)  # the first slot of each group's run
            pos = torch.arange(group.shape[0], device=group.device) - first
            self.layout.positions = (group, pos)
        return self.layout.positions

    def _buckets(self) -> tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]]:
        """The non-empty (expert, example) groups in buckets of similar sizes, each padded to a
        multiple of ``q`` (a multiple of 8, so that at most ``BUCKETS`` buckets cover the
        largest group — the small batched products run fastest on such sizes; groups all
        under 8 slots are not padded to 8): the row of
        every slot in one zero-padded buffer holding all buckets, and per bucket
        ``(first row, groups, padded size, the groups' ids expert·B + example)``."""
        import torch

        if self.layout.buckets is None:
            group, pos = self._positions()
            sizes = torch.bincount(group, minlength=len(self.counts) * self.batch)
            largest = int(sizes.max()) if sizes.numel() else 0
            quantum = 8 * max(1, -(-largest // (8 * BUCKETS)))
            if largest < 8:  # small groups: no padding to 8
                quantum = max(1, -(-largest // BUCKETS))
            level = torch.div(sizes + quantum - 1, quantum, rounding_mode="floor")  # 0: empty
            order = torch.argsort(level, stable=True)
            counts = torch.bincount(level, minlength=BUCKETS + 1).tolist()
            local = torch.empty_like(order)
            out, start, row = [], counts[0], 0
            for lev in range(1, len(counts)):
                if not counts[lev]:
                    continue
                groups = order[start : start + counts[lev]]
                local[groups] = row + torch.arange(counts[lev], device=group.device) * (
                    lev * quantum
                )
                out.append((row, counts[lev], lev * quantum, groups))
                row += counts[lev] * lev * quantum
                start += counts[lev]
            rows = local[group] + pos if group.numel() else pos
            source = torch.full((row,), group.numel(), dtype=torch.long, device=group.device)
            source[rows] = torch.arange(group.numel(), device=group.device)
            empty = (source == group.numel()).nonzero().squeeze(1)
            self.layout.buckets = (rows, out)
            self.layout.gather = (source.clamp_(max=max(group.numel() - 1, 0)), empty)
        return self.layout.buckets

    def _group_norms(
        self, a: torch.Tensor, b: torch.Tensor, count: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(computed ‖G_g‖², bound of that number's error)`` fp64 of ``count`` groups of
        ``size`` (zero-padded) slots ``a [count·size, R]``, ``b [count·size, C]``: by their
        certified Gram matrices while :func:`ghost_is_cheaper` says so for ``size``, else each
        group's ``[R, C]`` block (see :mod:`opake.dpsgd.certify`)."""
        import torch

        from opake.dpsgd.bookkeeping import ghost_is_cheaper
        from opake.dpsgd.certify import (
            GramTerms,
            contraction_error,
            dense_sq_norms,
            entry_error,
            error_bound,
            gamma64,
            gram,
            token_norms,
            wide,
        )

        ga, gb = a.view(count, size, -1), b.view(count, size, -1)
        rows, cols = int(ga.shape[-1]), int(gb.shape[-1])
        alpha, beta = token_norms(ga), token_norms(gb)
        if ghost_is_cheaper(size, rows, cols):
            sq = gram(ga).mul_(gram(gb)).sum(dim=(1, 2))
            a_err = entry_error(rows, ga.dtype, wide(ga))
            widen = 1.0 + 2.0 * gamma64(size + 2)
            sums = ((alpha * beta).sum(1) * widen, alpha.sum(1) * widen, beta.sum(1) * widen)
            terms = GramTerms.of(sums, size, a_err, entry_error(cols, gb.dtype, wide(gb)))
            return sq, error_bound(terms, terms)
        block = torch.bmm(ga.transpose(1, 2), gb).reshape(count, -1)
        sq, up = dense_sq_norms(block)
        s, pa, pb = (alpha * beta).sum(1), alpha.sum(1), beta.sum(1)
        d_rel, d_abs = contraction_error(s, pa, pb, steps=size, rows=size, shape=(rows, cols))
        norm = up.sqrt() + d_rel + d_abs
        return sq, (norm.square() - sq).clamp(min=0.0)

    def _norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(‖G_i‖² [B], bound of its error [B])`` fp64, bucket by bucket (cached)."""
        import torch

        if "sq" not in self.cache:
            _, buckets = self._buckets()
            total = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
            error = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
            if buckets:
                assert self.layout.gather is not None  # set with the buckets
                source, empty = self.layout.gather  # padded row <- slot; rows to zero
                a = self.a.index_select(0, source).index_fill_(0, empty, 0.0)
                b = self.b.index_select(0, source).index_fill_(0, empty, 0.0)
                for first, count, size, groups in buckets:
                    part = slice(first, first + count * size)
                    sq, err = self._group_norms(a[part], b[part], count, size)
                    owner = groups % self.batch
                    total.index_add_(0, owner, sq)
                    error.index_add_(0, owner, err)
            self.cache["sq"], self.cache["err"] = total, error
        return self.cache["sq"], self.cache["err"]

    def sq_norms(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(‖G_i‖² [B] fp64, None)`` over the (expert, example) groups bucket by bucket, each
        bucket by the Gram route or materialised, whichever :func:`ghost_is_cheaper` says for
        its padded size."""
        return self._norms()[0], None

    def certificate(self) -> PieceCert:
        """The certified bounds of these gradients and of :meth:`weighted_sum` (part of the
        clipping proof, see :mod:`opake.dpsgd.certify`): per (expert, example) group the Gram
        route's error bound or the materialised block's rounding; for the sum, one contraction
        per expert over its slots (an example has at most the largest group's slots in one
        expert)."""
        import torch

        from opake.dpsgd.bookkeeping import PieceCert
        from opake.dpsgd.certify import SAFE, contraction_error, token_norms

        sq, err = self._norms()
        alpha = token_norms(self.a[None])[0]
        beta = token_norms(self.b[None])[0]
        zeros = torch.zeros(self.batch, dtype=torch.float64, device=self.a.device)
        s = zeros.index_add(0, self.example, alpha * beta)
        pa = zeros.index_add(0, self.example, alpha)
        pb = zeros.index_add(0, self.example, beta)
        _, pos = self._positions()
        steps = int(pos.max()) + 1 if pos.numel() else 1
        _, rows, cols = self.shape
        slots = max(1, int(self.a.shape[0]))
        # one contraction per expert over its K_e slots: summed over the experts, the flushes'
        # part is that of one contraction over all Σ_e K_e = N slots
        rel, abs_ = contraction_error(s, pa, pb, steps=steps, rows=slots, shape=(rows, cols))
        return PieceCert(sq, err * (1.0 + SAFE), rel, abs_, steps, scale=s)

    def certified_inner(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """No cross term: a fused expert weight is read by its experts layer only."""
        raise OperationError(
            "book-keeping: a fused expert weight is also used by another layer; no rule forms "
            "that cross term. Use clipped_grad(engine='vmap')"
        )

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
        return _expert_sums(a, b, self.counts), None

    def inner_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """No cross term: a fused expert weight is read by its experts layer only."""
        raise OperationError(
            "book-keeping: a fused expert weight is also used by another layer; no rule forms "
            "that cross term. Use clipped_grad(engine='vmap')"
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


def _expert_sums(a: torch.Tensor, b: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """``[E, R, C]``: expert ``e``'s block ``Σ_s a_s b_sᵀ`` over its consecutive ``counts[e]``
    slots; one grouped matmul over the slots where the CPU kernel takes them, else one matmul
    per expert."""
    import torch

    experts, cols = len(counts), int(b.shape[-1])
    if a.shape[0] and grouped_mm_takes(a.T, b, cols=cols):
        ends = torch.tensor(counts, device=a.device).cumsum(0).to(torch.int32)
        out = torch.nn.functional.grouped_mm(a.T, b, offs=ends)
        unused = [e for e, count in enumerate(counts) if not count]
        if unused:  # an expert without slots adds exactly zero, whatever the kernel leaves
            out[unused] = 0.0
        return out
    out = a.new_zeros(experts, int(a.shape[-1]), cols)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[expert] = a[start : start + count].T @ b[start : start + count]
        start += count
    return out
