"""The ``broadcast_params`` book-keeping rule: parameters a block's forward only broadcasts.

Qwen3-Next's gated delta-net owns ``A_log`` and ``dt_bias`` ``[heads]`` and reads them once,
elementwise against a batch-first ``[B, T, heads]`` tensor
(``-A_log.exp() * softplus(a + dt_bias)``). While the book-keeping engine records, the patched
block (:func:`install_broadcast`) holds, for the duration of its forward, ``p + δ`` with a
tapped zero ``δ [B, 1, *p.shape]`` in place of each such parameter ``p``: broadcasting makes
example ``b``'s tokens read ``p + δ[b]``, so the gradient reaching ``δ[b]`` is example ``b``'s
gradient of ``p``, exactly, from the one batched backward. A forward that used the parameter in
another way (not broadcast against the batch) fails on the shapes, or the engine's check against
per-example autograd reports the mismatch.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.plugins import BookkeepingRule

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping.rules import LayerUse, Piece, RuleExample
    from opake.patches import Patcher

__all__ = ["BLOCKS", "RULE", "install_broadcast"]

#: block class → the parameters its forward reads only broadcast against ``[B, T, ...]``
BLOCKS: dict[str, tuple[str, ...]] = {"Qwen3NextGatedDeltaNet": ("A_log", "dt_bias")}
_MARK = "_opake_broadcast_params"


def _broadcast_forward(
    original: Callable[..., object], attrs: tuple[str, ...]
) -> Callable[..., object]:
    def forward(
        self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> object:
        import torch

        from opake.dpsgd.bookkeeping import implicit_use

        use = implicit_use(self)
        if use is None:
            return original(hidden_states, *args, **kwargs)
        names = tuple(use.params)  # the differentiated ones among attrs
        batch = hidden_states.shape[0]
        flat = [use.params[n].detach().reshape(-1) for n in names]
        sizes = [int(f.shape[0]) for f in flat]
        zero = flat[0].new_zeros(batch, sum(sizes))

        def build(grad: torch.Tensor) -> dict[str, torch.Tensor]:
            parts = torch.split(grad.float(), sizes, dim=1)
            return {
                n: p.reshape(batch, *use.params[n].shape) for n, p in zip(names, parts, strict=True)
            }

        tapped = use.tap(zero, build, inside=True)
        if not tapped.requires_grad:  # replayed by activation checkpointing: same graph shape
            tapped = tapped.detach().requires_grad_(True)
        delta = torch.split(tapped, sizes, dim=1)
        held = self._parameters
        saved = {n: held[n] for n in names}
        try:
            for n, f, d in zip(names, flat, delta, strict=True):
                shape = use.params[n].shape
                # a plain tensor stands in for the parameter (torch declares Parameter values)
                held[n] = (f + d).reshape(batch, 1, *shape)  # type: ignore[assignment]
            return original(hidden_states, *args, **kwargs)
        finally:
            held.update(saved)

    return forward


def patch_module(module: torch.nn.Module, attrs: tuple[str, ...], patcher: Patcher) -> None:
    """Give ``module`` the recording forward for its parameters ``attrs``."""
    forward = types.MethodType(_broadcast_forward(module.forward, attrs), module)
    patcher.set_attr(module, "forward", forward)
    patcher.set_attr(module, _MARK, attrs)


def install_broadcast(model: torch.nn.Module, patcher: Patcher) -> int:
    """Patch every module of a :data:`BLOCKS` class; returns how many."""
    from opake.models._swaps import modules_of_class

    count = 0
    for cls, attrs in BLOCKS.items():
        for module in modules_of_class(model, cls):
            patch_module(module, attrs, patcher)
            count += 1
    return count


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool:
    """A patched module whose differentiated own parameters it broadcasts per example."""
    marked = getattr(module, _MARK, None)
    return isinstance(marked, tuple) and attrs <= set(marked)


def pieces(use: LayerUse) -> dict[str, Piece]:
    """Never reached: the patched forward records its parameters itself (``inside=True``)."""
    raise use.fail("the block ran without its patched forward; apply_model_patches first")


def example() -> RuleExample:
    """A decay gate like Qwen3-Next's: ``-exp(A_log) * softplus(proj(x) + dt_bias)``."""
    import torch
    import torch.nn.functional as F

    from opake.dpsgd.bookkeeping.rules import RuleExample
    from opake.patches import Patcher

    class Decay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.proj = torch.nn.Linear(8, 4)
            self.A_log = torch.nn.Parameter(torch.randn(4, generator=gen) * 0.5)
            self.dt_bias = torch.nn.Parameter(torch.randn(4, generator=gen))
            patch_module(self, ("A_log", "dt_bias"), Patcher())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.proj(torch.tanh(x))
            return -self.A_log.exp() * F.softplus(a + self.dt_bias)

    return RuleExample(Decay(), width=8)


RULE = BookkeepingRule(
    "broadcast_params",
    matches=matches,
    pieces=pieces,
    produces={"*": "dense"},
    example=example,
)
