"""``DPTraining(..., shard=True)``: the step on per-layer sharded compute (FSDP2 level 2).

With ``shard=True`` the clipped sums come from
:func:`~opake.dpsgd.distributed.sharded_clipped_grad` (the loss runs the ``fully_shard``-ed
module itself; FSDP gathers one unit at a time) and the update from
:class:`~opake.dpsgd.distributed.ShardedDPOptimizer` (reduce-scatter once per logical step,
each rank's rows of one full-size noise draw, ``÷ q·N``, the optimizer on the shards). The
sampler (this rank's shard of the global Poisson batch), the accountant, the budget and the
logical steps are :class:`~opake.dpsgd.training.DPTraining`'s own, as under DDP.

What level 2 does not support is refused here, before anything is built (see
``docs/design/fsdp2.md``). Checkpoints of a sharded training are directories:
``DPTraining.save`` / ``load`` go through
:func:`~opake.dpsgd.distributed.save_sharded_checkpoint` /
:func:`~opake.dpsgd.distributed.load_sharded_checkpoint` (``._persist``); ``state_dict()`` is
refused (each rank holds its own shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from opake.dpsgd.clipping import ClipState
    from opake.dpsgd.distributed import DistributedDPOptimizer, ShardedClippedGradFn

__all__ = ["ShardedStep", "check_shard", "dp_optimizer"]

_HOW = "DPTraining(shard=True) (per-layer sharded compute, FSDP2 level 2)"


def _refuse(what: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"{_HOW}: {what}; {fix}")


def _check_settings(settings: tuple[Any, ...]) -> None:
    """Refuse what level 2 does not do (each with what to do instead)."""
    engine, compile, privacy_units, args, offload_state, clipping_norm, sampler = settings
    if engine == "vmap":
        raise _refuse(
            "engine='vmap' is not supported (per-example vmap needs the whole model per example)",
            "use engine='auto' or 'bookkeeping', or level 1 (ShardedDPOptimizer with "
            "gather_full_params) for the vmap engine",
        )
    if compile:
        raise _refuse(
            "compile=True is not supported (FSDP's hooks and the engine's taps run eagerly)",
            "build it with compile=False",
        )
    if privacy_units is not None:
        raise _refuse(
            "privacy_units is not supported (a unit is not clipped as one across sharded "
            "calls yet)",
            "train user-level DP without shard=True",
        )
    if args:
        raise _refuse(
            "args=... is not supported (the loss runs the sharded module itself)",
            "close over fixed values in loss_fn(*batch)",
        )
    if offload_state:
        raise _refuse(
            "offload_state=True is not supported (the optimizer state is sharded already)",
            "use fully_shard(..., offload_policy=CPUOffloadPolicy()) to offload it",
        )
    from opake.dpsgd.clipping._api import _as_state
    from opake.dpsgd.clipping._base import ClipState

    if type(_as_state(clipping_norm)).advance is not ClipState.advance:
        raise _refuse(
            "adaptive clipping is not supported (a clipping state that changes every step)",
            "use a fixed clipping_norm (a float or a mapping group → bound)",
        )
    if sampler != "poisson":
        raise _refuse(
            f"sampler={sampler!r} is not supported",
            "use sampler='poisson' (each call pads the ranks' batches to the largest itself)",
        )


def check_shard(
    shard: object,
    module: object,
    params: Mapping[str, Any],
    process_group: ProcessGroup | None,
    settings: tuple[Any, ...],
) -> tuple[torch.nn.Module | None, ProcessGroup | None]:
    """``(model, group)``: the ``fully_shard``-ed module and its mesh's process group with
    ``shard=True`` (checked); ``(None, process_group)`` without. ``settings``: the other
    ``DPTraining`` options level 2 restricts, ``(engine, compile, privacy_units, args,
    offload_state, clipping_norm, sampler)``.

    >>> check_shard(True, None, {}, None, ("vmap", False, None, (), False, 1.0, "poisson"))
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: DPTraining(shard=True) ...: engine='vmap' is not ...
    """
    import torch
    import torch.distributed as dist

    if not isinstance(shard, bool):
        raise InputTypeError(f"shard={shard!r}: expected True or False")
    if not shard:
        return None, process_group
    _check_settings(settings)
    if not (dist.is_available() and dist.is_initialized()):
        raise _refuse(
            "no torch.distributed process group is initialised",
            "launch with torchrun and call opake.dpsgd.distributed.init_distributed() (or "
            "torch.distributed.init_process_group) and fully_shard the model first",
        )
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(
            f"{_HOW}: module={type(module).__name__}: expected the fully_shard-ed nn.Module "
            "(module=model)"
        )
    from opake.dpsgd.distributed.sharded._plan import mesh_group

    try:
        group = mesh_group(module)
    except ConfigurationError:
        raise _refuse(
            "the module has no DTensor parameters (it was not fully_shard-ed)",
            "call fully_shard on its blocks and on the root (one 1-D device mesh) before "
            "building DPTraining, or drop shard=True",
        ) from None
    if process_group is not None and process_group is not group:
        raise _refuse(
            "process_group differs from the group of the model's device mesh",
            "drop process_group (the mesh's group is used)",
        )
    names = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    if sorted(params) != names:
        raise _refuse(
            f"params names {sorted(params)[:5]} are not the module's trainable parameters "
            f"{names[:5]}",
            "pass {n: p for n, p in model.named_parameters() if p.requires_grad}",
        )
    return module, group


class ShardedStep:
    """``DPTraining``'s view of :class:`~opake.dpsgd.distributed.ShardedClippedGradFn`: called
    like ``clipped_grad``'s ``grad_fn`` (``params`` first: ignored, the sharded module is run
    with FSDP's own parameters)."""

    def __init__(self, inner: ShardedClippedGradFn) -> None:
        self._inner = inner
        self._whole = False

    @property
    def engine(self) -> str | None:
        """``"bookkeeping"`` after a call (``None`` before)."""
        return self._inner.engine

    @contextlib.contextmanager
    def whole_step(self) -> Iterator[None]:
        """The next call is its logical step's only physical batch (``DPTraining.step`` on a
        new step): each parameter's clipped sum is reduce-scattered as soon as it is formed
        (``reduce_scatter=True``), so a rank never holds all full-size sums at once."""
        self._whole = True
        try:
            yield
        finally:
            self._whole = False

    def new_step(self) -> None:
        """A logical step ended or was dropped: the next call starts one (every rank alike)."""
        self._whole = False
        self._inner.new_step()

    def __call__(self, params: object, *batch: Any, **kwargs: Any) -> tuple[Any, ClipState]:
        if self._whole:  # a fixed clipping state (adaptive is refused): end_step only counts
            self._whole = False
            kwargs.update(end_step=True, reduce_scatter=True)
        return self._inner(*batch, **kwargs)


def sharded_step(
    loss_fn: Callable[..., Any],
    model: torch.nn.Module,
    clipping_norm: float | Mapping[str, float] | ClipState,
    microbatch_size: int | None,
    batch_args: int,
) -> tuple[ShardedStep, ClipState]:
    """The sharded clipped-gradient function (``loss_fn(*batch)`` → per-example losses)."""
    from opake.dpsgd.distributed import sharded_clipped_grad

    grad_fn, state = sharded_clipped_grad(
        loss_fn,
        model,
        clipping_norm=clipping_norm,
        batch_argnums=tuple(range(batch_args)),
        microbatch_size=microbatch_size,
        return_aux=True,
    )
    return ShardedStep(grad_fn), state


def dp_optimizer(
    optimizer: torch.optim.Optimizer,
    module: torch.nn.Module | Mapping[str, torch.Tensor],
    sharded: torch.nn.Module | None,
    how: tuple[ProcessGroup | None, float, int | None, bool, str],
    parts: tuple[Any, Any, Any],
) -> DistributedDPOptimizer:
    """The step's DP optimizer: a ``ShardedDPOptimizer`` over the sharded module (its mesh's
    group), else a ``DistributedDPOptimizer`` (a plain DP optimizer in one process).

    ``how``: ``(process_group, σ, seed, offload_state, unused_params)``; ``parts``:
    ``(sampler, accountant, clip_state)``.
    """
    from opake.dpsgd.distributed import DistributedDPOptimizer, ShardedDPOptimizer
    from opake.dpsgd.training._options import _rates_of

    group, sigma, seed, offload_state, unused_params = how
    sampler, accountant, clip_state = parts
    common: dict[str, Any] = {
        "noise_multiplier": sigma,
        # a unit sampler's rate and divisor are passed as numbers: DPOptimizer refuses the
        # sampler itself, since it cannot see that each unit is clipped as one (here it is)
        **_rates_of(sampler),
        "accountant": accountant,
        "count_noise_multiplier": getattr(clip_state, "count_noise_multiplier", None),
        "seed": seed,  # None: a secure noise key, shared by the ranks, never stored
        "offload_state": offload_state,
        "unused_params": unused_params,
    }
    if sharded is not None:
        return ShardedDPOptimizer(optimizer, sharded, **common)
    return DistributedDPOptimizer(optimizer, module, process_group=group, **common)
