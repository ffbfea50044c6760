"""The book-keeping runner over a ``fully_shard``-ed module: FSDP's own parameters, no swap.

:class:`~opake.dpsgd.bookkeeping._runner.BookkeepingRunner` records a forward that runs the
differentiated tensors ``clipped_grad`` passes (``fmodel(params, ...)``) and checks, in every
layer hook, that the layer ran with exactly those tensors. Through a ``fully_shard``-ed module
that is impossible by design: FSDP2's pre-forward hook of each unit all-gathers the unit's
sharded (``DTensor``) parameters and swaps the *gathered* tensors in, overriding whatever
``functional_call`` substituted (the trap of ``docs/design/fsdp2.md``). Here the module runs its
own parameters instead, and FSDP gathers them one unit at a time:

- the differentiated "tensors" are the module's sharded parameters themselves (their global
  shape is what the norms and sums need; their values are never read);
- a layer hook accepts FSDP's gathered parameter in place of the sharded one (same global
  shape, a plain tensor), or the sharded one itself when the layer is an FSDP unit of its own
  (FSDP's post-forward hook, registered first, resharded it) for rules that never read weights;
- nothing is swapped into the module for the backward (``holding`` would fight FSDP's own
  reshard and leave gathered parameters behind).

The backward is the runner's own: w.r.t. a scalar sink only, so autograd computes no weight
gradient; FSDP's pre-backward hooks re-gather each unit for the activation gradients and its
post-backward hooks reshard it, with no gradient to reduce-scatter.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._runner import BookkeepingRunner
from opake.dpsgd.distributed._rows import _is_sharded
from opake.dpsgd.distributed.sharded._check import RowCheck

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._use import LayerRule

__all__ = ["WEIGHT_FREE_RULES", "ShardedRunner"]

#: built-in rules whose pieces never read the layer's weights (inputs and output gradients only)
WEIGHT_FREE_RULES = frozenset({"linear", "conv1d", "embedding"})


class ShardedRunner(BookkeepingRunner):
    """:class:`BookkeepingRunner` for a loss that runs a ``fully_shard``-ed module directly;
    ``row_check`` is level 2's per-example check (:mod:`._check`) over the mesh's ``group``."""

    def __init__(self, *args: Any, group: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.row_check = RowCheck(group)

    def _layer_params(self, layer: LayerRule, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        params = {attr: getattr(module, attr) for attr in module._parameters}
        for attr, name in layer.params:
            tensor, full = params[attr], self._diff[name]
            if tensor is full or (tensor is not None and _is_sharded(tensor)):
                if tensor is full and not _is_sharded(full):
                    continue  # a parameter FSDP does not manage: the tensor itself
                if layer.rule in WEIGHT_FREE_RULES:
                    continue
                raise OperationError(
                    f"sharded book-keeping: layer {layer.module!r} is an FSDP unit by itself "
                    f"and its rule {layer.rule!r} reads its weights, which FSDP resharded "
                    "before the engine's hook ran; fully_shard the block around it instead"
                )
            if tensor is None or tuple(tensor.shape) != tuple(full.shape):
                got = None if tensor is None else tuple(tensor.shape)
                raise OperationError(
                    f"sharded book-keeping: layer {layer.module!r} ran with a {attr!r} of shape "
                    f"{got}; the gathered parameter {name!r} has {tuple(full.shape)}. The loss "
                    "must run the fully_shard-ed module itself (model(...)), so that FSDP "
                    "gathers each unit's parameters"
                )
        return params

    def _hold(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
