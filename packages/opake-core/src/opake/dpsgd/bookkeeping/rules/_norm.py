"""The closed form shared by every norm rule: ``y = x̂ ⊙ (w + offset) + b``.

With ``x̂`` the normalised input (fixed by the input, whatever the weights), the per-example
gradients are ``Σ_t g_t ⊙ x̂_t`` for the weight (any ``offset``: Gemma's ``(1 + w)`` included)
and ``Σ_t g_t`` for the bias.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from opake.dpsgd.bookkeeping._pieces import Dense
from opake.dpsgd.bookkeeping._use import LayerUse

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["CHECK_EVERY", "last_dim_normalised", "norm_pieces"]

#: a checked norm module's output is compared with its declared formula on its first use and
#: then on every ``CHECK_EVERY``-th (the cadence of the engine's check against autograd)
CHECK_EVERY = 64
_uses: weakref.WeakKeyDictionary[object, tuple[object, int]] = weakref.WeakKeyDictionary()


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
    wrong norms. Checked on the module's first use under each plan, whenever its forward
    changes, and every :data:`CHECK_EVERY`-th use (its formula is its forward's code).
    """
    assert use.grad is not None
    weight = use.params.get("weight")
    bias = use.params.get("bias")
    shape = tuple(weight.shape if weight is not None else normalised.shape[-1:])
    h = normalised.float().reshape(use.batch, -1, *shape)
    if check and _due(use):
        _check_output(use, h, weight, bias, offset)
    g = use.grad.float().reshape(use.batch, -1, *shape)
    out: dict[str, Piece] = {}
    if "weight" in use.attrs:
        out["weight"] = Dense((g * h).sum(dim=1))
    if "bias" in use.attrs:
        out["bias"] = Dense(g.sum(dim=1))
    return out


def _due(use: LayerUse) -> bool:
    """Check on the first use under each plan (a new ``clipped_grad``, a new set of
    differentiated parameters), whenever the module's forward changes (an instance override,
    a patch) and every :data:`CHECK_EVERY`-th use."""
    module = use.module
    forward = (type(module).forward, module.__dict__.get("forward"))
    key = (id(use.layer), forward)
    last, count = _uses.get(module, (None, 0))
    count = count + 1 if last == key else 0
    _uses[module] = (key, count)
    return count % CHECK_EVERY == 0


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
    if output.numel() != want.numel():
        raise use.fail(
            f"its output has {output.numel()} numbers; its norm rule expects {want.numel()}"
        )
    tol = 1e-4 if output.dtype in (torch.float32, torch.float64) else 2e-2
    err = (output.float().reshape(want.shape) - want).abs_()
    # |got − want| ≤ tol·(1 + |want|) everywhere (a NaN comparison is False: a non-finite
    # output drops its example from the sum anyway)
    if bool((err > want.abs().mul_(tol).add_(tol)).any()):  # (want may be h itself)
        raise use.fail(
            f"its output is not x̂ ⊙ (weight + {offset}) (+ bias) as its norm rule declares "
            "(a different norm formula, epsilon attribute or weight offset)"
        )
