"""``cached_signature``: the same binding as torch's per-call signature, computed once."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from opake.core.errors import InputTypeError
from opake.functional import cached_signature


def _scaled(decorate: bool) -> Any:
    class Scaled(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: torch.Tensor, scale: float = 3.0) -> torch.Tensor:
            return x * scale

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad * ctx.scale, None

    return cached_signature(Scaled) if decorate else Scaled


def test_signature_is_kept_on_forward() -> None:
    fn = _scaled(True)
    assert fn.forward.__signature__ == inspect.signature(_scaled(False).forward)
    assert inspect.signature(fn.forward) is fn.forward.__signature__


@pytest.mark.parametrize("decorate", [False, True])
def test_binding_defaults_grad_and_vmap(decorate: bool) -> None:
    fn = _scaled(decorate)
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    assert fn.apply(x).tolist() == [3.0, -6.0]  # default scale bound
    assert fn.apply(x, 0.5).tolist() == [0.5, -1.0]
    (g,) = torch.autograd.grad(fn.apply(x, 2.0).sum(), x)
    assert g.tolist() == [2.0, 2.0]
    per_example = torch.func.vmap(torch.func.grad(lambda v: fn.apply(v).sum()))(torch.ones(4, 2))
    assert torch.equal(per_example, torch.full((4, 2), 3.0))
    with pytest.raises(TypeError):  # a wrong call still fails in the binding, as before
        fn.apply(x, 1.0, 2.0, 3.0)


def test_refuses_a_class_without_static_forward() -> None:
    class OldStyle(torch.autograd.Function):
        def forward(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x

    with pytest.raises(InputTypeError, match="staticmethod forward"):
        cached_signature(OldStyle)
    with pytest.raises(InputTypeError, match="staticmethod forward"):
        cached_signature(int)


def test_apply_builds_no_signature() -> None:
    """The point of it: apply no longer derives the signature (counted, not timed)."""
    built = []
    original = inspect.Signature.__init__

    def counting(self: inspect.Signature, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        original(self, *args, **kwargs)

    x = torch.ones(2)
    cached, plain = _scaled(True), _scaled(False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inspect.Signature, "__init__", counting)
        cached.apply(x)
        assert not built
        plain.apply(x)
        assert built
