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

__all__ = ["certificate", "certified_inner", "outer_view"]


def outer_view(op: LinearCEExampleGrads) -> OuterSum:
    """The :class:`~opake.dpsgd.bookkeeping.OuterSum` ``(u, g ⊙ h)`` of a kept operator."""
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
