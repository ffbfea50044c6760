"""The clipping certificate of :class:`~._example_grads.LinearCEExampleGrads`.

Where the forward kept the logit gradients ``u`` (``[N, V]`` fp32, :mod:`._kept`), example
``i``'s weight gradient is ``G_i = Σ_t u_t (g_t h_t)ᵀ``, and the clipped sum is one contraction
``Uᵀ (fl(fl(w g) ⊙ H))`` (:func:`~._kept.kept_weighted_sum`): an
:class:`~opake.dpsgd.bookkeeping.OuterSum` with ``a = u`` and ``b = fl(g ⊙ h)``, whose scaled
side the sum forms within three roundings of ``w·b`` — exactly what the book-keeping
engine's generic certificate covers (:func:`opake.dpsgd.bookkeeping.certify_piece`). The
tied-embedding cross term is the generic inner product of that view with the embedding's use.

Without kept gradients the clipped sum recomputes the logits tile by tile, and nothing in the
proof's assumptions makes that recomputation round as the norms' did; such an operator does not
certify itself (the engine then uses the vmap engine, saying why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping import OuterSum, PieceCert
    from opake.kernels.chunked._example_grads import LinearCEExampleGrads

__all__ = ["certificate", "certified_inner", "example_rows", "outer_view"]


def outer_view(op: LinearCEExampleGrads) -> OuterSum:
    """The :class:`~opake.dpsgd.bookkeeping.OuterSum` ``(u, g ⊙ h)`` of a kept operator.

    ``a`` is a view of the kept logit gradients ``[B, T, V]`` (fp32, no copy), ``b = fl(g·h)``
    ``[B, T, H]`` (formed on each call). Under privacy units (``grad_fn(..., units=ids)``) the
    book-keeping engine regroups this pair like any ``OuterSum`` — each unit's rows end to end,
    ``[U, k·T, ·]`` with exact zero padding (``k`` the most rows of any unit in the chunk) — so
    the head stays inside the proof, its unit gradient certified and summed generically. That
    regrouping copies ``a``: ``4·U·k·T·V`` bytes more while the pieces are built, on top of the
    kept ``4·B·T·V`` (equal units: as much again, e.g. 4.2 GB for ``B·T = 8 × 1024`` rows and
    Llama 3's 128 256-token vocabulary, 1.6 GB for GPT-2's 50 257; uneven units pad up to
    ``k``). Raises :class:`~opake.core.errors.OperationError` when ``u`` was not kept.
    """
    import torch

    from opake.dpsgd.bookkeeping import OuterSum

    kept = op._kept
    if kept is None or kept.u is None:
        raise OperationError(
            "book-keeping: the linear cross-entropy's per-example gradients were not kept in "
            "the forward (they did not fit a quarter of the available memory), so its clipped "
            "sum recomputes the logits, which the clipping proof does not cover; use a smaller "
            "microbatch (microbatch_size) so that they fit, or clipped_grad(engine='vmap')"
        )
    batch, steps, _ = op.hidden.shape
    u = kept.u.view(batch, steps, -1)
    # b = fl(g·h): the sum adds fl(fl(w·g)·h), within three roundings of w·b (the bound's
    # budget for the scaled side); fp64 hidden states keep b in fp64 (their conversion to fp32
    # in the sum is then one of the three)
    hidden = op.hidden if op.hidden.dtype == torch.float64 else op.hidden.float()
    b = op.token_grads.to(hidden.dtype).unsqueeze(-1) * hidden
    return OuterSum(u, b)


def certificate(op: LinearCEExampleGrads) -> PieceCert:
    """The certified bounds of ``op``'s weight gradients and of its weighted sum."""
    from opake.dpsgd.bookkeeping import certify_piece

    return certify_piece(outer_view(op))


def certified_inner(
    op: LinearCEExampleGrads, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``⟨G_i, Σ_s a_s ⊗ b_s⟩`` and the bound of its error (fp64 ``[B]``)."""
    import torch

    from opake.dpsgd.bookkeeping import OuterSum, certify_inner

    rows = op.shape[0] if a.dtype in (torch.int64, torch.int32) else None
    other = OuterSum(a.long() if rows is not None else a, b, rows=rows)
    return certify_inner(outer_view(op), other)


def example_rows(op: LinearCEExampleGrads, index: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of example ``index``'s weight gradient, fp64 ``[stop - start, H]``
    (the exact route): ``d`` recomputed for that vocabulary slice, then ``dᵀ h`` in fp64."""
    import torch

    from opake.kernels._math import transform_logits_
    from opake.kernels.chunked._logit_tiles import _dlogits_

    with torch.no_grad():
        steps = op.hidden.shape[1]
        vocab = op.weight.shape[0]
        h = op.hidden[index]
        lse = op._lse_all()[index * steps : (index + 1) * steps]
        z = h.to(op.weight.dtype) @ op.weight[start:stop].t()
        if op.bias is not None:
            z = z + op.bias[start:stop]
        z = transform_logits_(z.to(torch.float32).contiguous(), op.spec)
        scratch = torch.empty_like(z) if op.spec.softcap is not None else None
        labels, grads = op.labels[index], op.token_grads[index]
        d = _dlogits_(z, labels, lse, grads, start, vocab, op.spec, scratch)
        return d.double().t() @ h.double()
