"""The fallback for a leaf layer without a closed-form rule: its per-example gradients by
``vmap`` over that layer alone, checked to reproduce the batched output.

Exact for any layer that treats examples independently (the check catches one that mixes
them); it costs one ``vmap`` of the layer's forward and backward, so a frequent layer without a
rule is worth a closed-form rule of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._pieces import Dense
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["RULE", "example", "matches", "pieces"]

_Tree = TypeVar("_Tree")


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool | str:
    """Any leaf layer (one without parameterised submodules)."""
    nested = [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(False))]
    if nested:
        return (
            f"{type(module).__name__} owns trainable parameter(s) {sorted(attrs)} directly and "
            f"has parameterised submodules ({nested[:3]}); no rule, and the per-layer fallback "
            "needs a leaf layer"
        )
    return True


def _batch_dims(use: LayerUse) -> tuple[Any, Any]:
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    def batched(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == use.batch

    dims = (
        tree_map(lambda x: 0 if batched(x) else None, use.args),
        tree_map(lambda x: 0 if batched(x) else None, use.kwargs),
    )
    if 0 not in tree_leaves(dims):
        raise use.fail(f"no input has the batch ({use.batch}) on dimension 0")
    return dims


def _check_output(use: LayerUse, y: torch.Tensor) -> None:
    import torch

    output = use.output
    assert output is not None
    tol = 1e-5 if output.dtype in (torch.float32, torch.float64) else 1e-2
    # an example whose activations are not finite (e.g. a fully masked row in half
    # precision) must not poison the tolerance: it is dropped from the sum later anyway
    finite = output.float().abs().nan_to_num(0.0, posinf=0.0)
    scale = float(finite.max()) if finite.numel() else 0.0
    if y.shape != output.shape or not torch.allclose(
        y.float(), output.float(), rtol=tol, atol=tol * scale, equal_nan=True
    ):
        raise use.fail(
            "it gives a different output on one example than in the batch: it mixes examples "
            "or does not take the batch on dimension 0, so no per-example rule applies"
        )


def pieces(use: LayerUse) -> dict[str, Piece]:
    """Per-example gradients of the layer's differentiated parameters by ``vmap``."""
    import torch
    from torch.func import functional_call, vjp, vmap
    from torch.utils._pytree import tree_map

    names = use.attrs
    train = {attr: use.params[attr].detach() for attr in names}
    const = {k: v.detach() for k, v in use.params.items() if k not in names and v is not None}
    dims = _batch_dims(use)

    def unsqueeze(tree: _Tree, tree_dims: object) -> _Tree:
        # the same structure, its batched leaves given back a batch dimension of one
        out: _Tree = tree_map(
            lambda x, d: x[None] if d == 0 else x, tree, tree_dims, is_leaf=lambda x: x is None
        )
        return out

    def one(
        args: tuple[Any, ...], kwargs: dict[str, Any], g: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(
                use.module, {**p, **const}, unsqueeze(args, dims[0]), unsqueeze(kwargs, dims[1])
            )
            y: torch.Tensor = out[0]  # row 0 of the output (a tensor: the recording hook checked)
            return y

        y, pullback = vjp(f, train)[:2]
        (grads,) = pullback(g)
        return y, grads

    assert use.grad is not None
    with torch.no_grad():
        y, grads = vmap(one, in_dims=(dims[0], dims[1], 0))(use.args, use.kwargs, use.grad)
    _check_output(use, y)
    return {attr: Dense(grads[attr]) for attr in names}


class _Scale:
    """Builds a leaf layer without a closed-form rule (``x ⊙ w``)."""

    @staticmethod
    def build(width: int) -> torch.nn.Module:
        import torch

        class Scale(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(width))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight

        return Scale()


def example() -> RuleExample:
    """A leaf layer ``x ⊙ w`` of width 8 over 5 tokens."""
    return RuleExample(_Scale.build(8), width=8)


RULE = BookkeepingRule(
    "per_layer",
    matches=matches,
    pieces=pieces,
    produces={"*": "dense"},
    example=example,
    priority=-100,
    keeps_output=True,
    broadcast=False,
)
