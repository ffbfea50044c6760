"""What level 2 accepts: a ``fully_shard``-ed module on one 1-D mesh, every layer with a rule.

Per-layer sharded compute never gathers the whole model, so a layer the book-keeping engine
has no closed-form rule for cannot fall back to anything: the per-layer ``vmap`` rule runs the
layer again on its weights after the backward, when FSDP has resharded them. Such a layer makes
the call fail with a :class:`~opake.core.errors.ConfigurationError` naming it — never a silent
gather of everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.bookkeeping._plan import BookkeepingPlan, bookkeeping_plan
from opake.dpsgd.distributed._rows import _is_sharded

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "FALLBACK_RULE",
    "mesh_group",
    "refuse_batch_statistics",
    "reshard_units",
    "sharded_plan",
    "trainable",
]

#: the book-keeping rule that is a fallback, not a rule: vmap over the layer and its weights
FALLBACK_RULE = "per_layer"


def mesh_group(model: object) -> ProcessGroup:
    """The process group of the module's one 1-D device mesh; raises when it is not sharded."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(
            f"model={type(model).__name__}: expected the fully_shard-ed torch.nn.Module"
        )
    sharded = [p for p in model.parameters() if _is_sharded(p)]
    if not sharded:
        raise ConfigurationError(
            "sharded_clipped_grad: the module has no DTensor parameters (it was not "
            "fully_shard-ed); call fully_shard on its blocks and on the root first, or use "
            "clipped_grad for an unsharded model"
        )
    mesh = sharded[0].device_mesh
    # equal meshes, not one object: DTensor caches its specs, so parameters of one mesh can
    # report equal mesh objects of an earlier fully_shard call
    others = [p.device_mesh for p in sharded if p.device_mesh != mesh]
    if others or mesh.ndim != 1:
        raise ConfigurationError(
            "sharded_clipped_grad supports one 1-D device mesh (data-parallel sharding); got "
            f"meshes {mesh}{''.join(f', {m}' for m in others[:1])}"
        )
    return mesh.get_group()


def reshard_units(model: torch.nn.Module) -> None:
    """Reshard every FSDP unit of ``model``: a forward without backward (an evaluation) leaves
    the root unit gathered, its gathered tensors registered as the parameters."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters by name (sharded ones as their ``DTensor``), every
    FSDP unit resharded first (:func:`reshard_units`)."""
    reshard_units(model)
    params: dict[str, torch.Tensor] = {
        name: p for name, p in model.named_parameters() if p.requires_grad
    }
    if not params:
        raise ConfigurationError(
            "sharded_clipped_grad: the module has no trainable parameter (requires_grad=True)"
        )
    return params


def refuse_batch_statistics(model: torch.nn.Module) -> None:
    """Refuse a batch norm that normalises with batch statistics — in training mode, or in
    eval mode without running statistics (``track_running_stats=False``), the condition under
    which ``_BatchNorm.forward`` uses them: they mix the examples, so one example's records
    would carry the others'. Checked at construction and at every call (the mode can change);
    a functional ``F.batch_norm(training=True)`` is caught by the per-example check."""
    from torch.nn.modules.batchnorm import _BatchNorm

    mixing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm)
        and (m.training or (m.running_mean is None and m.running_var is None))
    ]
    if mixing:
        raise ConfigurationError(
            f"sharded_clipped_grad: {', '.join(mixing[:5])} normalises with batch statistics "
            "(training mode, or no running statistics), which mixes the examples of a batch: "
            "per-example clipping would not bound one example's influence. Put it in eval "
            "mode with running statistics (track_running_stats=True, .eval()), or replace it "
            "by a per-example normalisation (LayerNorm, GroupNorm)"
        )


def sharded_plan(
    model: torch.nn.Module, names: Iterable[str], *, trusted: Iterable[str] = ()
) -> BookkeepingPlan:
    """The book-keeping plan of ``names``; raises unless every layer has a closed-form rule.

    >>> import torch
    >>> plan = sharded_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0.weight"])
    >>> [layer.rule for layer in plan.layers]
    ['linear']
    >>> class Scale(torch.nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.ones(2))
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return x * self.weight
    >>> sharded_plan(torch.nn.Sequential(Scale()), ["0.weight"])
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: sharded_clipped_grad: no book-keeping rule for ...
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> sharded_plan(net, ["0.weight"])
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: sharded_clipped_grad: 1 (BatchNorm1d) normalises ...
    """
    refuse_batch_statistics(model)
    plan = bookkeeping_plan(model, names, trusted=trusted)
    problems = [f"{what} ({why})" for what, why in plan.unsupported]
    problems += [
        f"{layer.module or '<root>'} ({type(model.get_submodule(layer.module)).__name__}: only "
        "the per-layer vmap fallback matches it, which needs the layer's weights after FSDP "
        "resharded them)"
        for layer in plan.layers
        if layer.rule == FALLBACK_RULE
    ]
    if problems:
        raise ConfigurationError(
            "sharded_clipped_grad: no book-keeping rule for "
            + "; ".join(problems)
            + ". Per-layer sharded compute needs a closed-form rule for every layer with a "
            "trainable parameter (nothing is gathered to fall back on): freeze those "
            "parameters, register a rule (docs/guide/extending.md), or use level 1 "
            "(ShardedDPOptimizer with gather_full_params and clipped_grad)"
        )
    return plan
