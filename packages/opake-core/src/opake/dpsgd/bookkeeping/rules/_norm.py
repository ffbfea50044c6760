"""The closed form shared by every norm rule: ``y = x̂ ⊙ (w + offset) + b``.

With ``x̂`` the normalised input (fixed by the input, whatever the weights), the per-example
gradients are ``Σ_t g_t ⊙ x̂_t`` for the weight (any ``offset``: Gemma's ``(1 + w)`` included)
and ``Σ_t g_t`` for the bias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.dpsgd.bookkeeping._rules import Dense
from opake.dpsgd.bookkeeping._use import LayerUse

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._rules import Piece

__all__ = ["last_dim_normalised", "norm_pieces"]


def last_dim_normalised(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """``x̂`` over the last dimension in fp32: ``kind="rms"``: ``x / √(mean(x²) + ε)``;
    ``kind="layer"``: ``(x − mean) / √(var + ε)`` (Hugging Face's norm modules).

    >>> import torch
    >>> last_dim_normalised(torch.tensor([[3.0, -3.0]]), "rms", 0.0).tolist()
    [[1.0, -1.0]]
    """
    import torch

    x = x.float()
    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def norm_pieces(
    use: LayerUse,
    normalised: torch.Tensor,
    *,
    offset: float = 0.0,
    check: bool = False,
) -> dict[str, Piece]:
    """The pieces of ``y = x̂ ⊙ (w + offset) + b`` from ``x̂`` (``normalised``, any shape whose
    trailing dimensions are the weight's).

    ``check``: first recompute the output from ``x̂`` and the weights and compare it with the
    recorded one (the rule must declare ``keeps_output``): a norm that computes something else
    than it was declared to raises :class:`~opake.core.errors.OperationError` instead of giving
    wrong norms.
    """
    assert use.grad is not None
    weight = use.params.get("weight")
    bias = use.params.get("bias")
    shape = tuple(weight.shape if weight is not None else normalised.shape[-1:])
    h = normalised.float().reshape(use.batch, -1, *shape)
    if check:
        _check_output(use, h, weight, bias, offset)
    g = use.grad.float().reshape(use.batch, -1, *shape)
    out: dict[str, Piece] = {}
    if "weight" in use.attrs:
        out["weight"] = Dense((g * h).sum(dim=1))
    if "bias" in use.attrs:
        out["bias"] = Dense(g.sum(dim=1))
    return out


def _check_output(
    use: LayerUse,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    offset: float,
) -> None:
    import torch

    output = use.output
    if output is None:
        raise use.fail("the norm rule checks the output but its rule does not keep it")
    want = h if weight is None else h * (weight.detach().float() + offset)
    if bias is not None:
        want = want + bias.detach().float()
    got = output.float().reshape(want.shape) if output.numel() == want.numel() else None
    tol = 1e-4 if output.dtype in (torch.float32, torch.float64) else 2e-2
    finite = torch.isfinite(want)
    if got is None or not torch.allclose(
        torch.where(finite, got, 0.0), torch.where(finite, want, 0.0), rtol=tol, atol=tol
    ):
        raise use.fail(
            f"its output is not x̂ ⊙ (weight + {offset}) (+ bias) as its norm rule declares "
            "(a different norm formula, epsilon attribute or weight offset)"
        )
