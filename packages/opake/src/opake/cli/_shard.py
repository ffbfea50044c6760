"""``opake train --shard``: per-layer sharded compute (FSDP2 level 2) under ``torchrun``.

Every decoder layer (the model's ``_no_split_modules`` classes) and the root are
``fully_shard``-ed over one 1-D mesh of all ranks (``cpu``/gloo on CPU, ``cuda``/nccl on GPU);
the step is ``DPTraining(..., shard=True)``: each rank runs the book-keeping engine through the
sharded model on its share of each global Poisson batch, FSDP gathering one layer at a time.
The model runs unpatched (a patched model's loss-only head holds per-example gradients
implicitly, which per-layer sharded compute cannot bound). Evaluation runs on every rank (each
forward gathers the layers); the trained model is gathered once at the end and rank 0 saves it.
The checkpoint is a directory of shards (``DPTraining.save``): resume with the same number of
processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.cli._plan import RunPlan

__all__ = ["check_shard", "full_model", "prepare_sharded", "shard_model", "sharded_loss"]

#: what ``--shard`` cannot be combined with (per-layer sharded compute: the book-keeping engine)
_REFUSED = (
    ("compile", "the sharded step runs FSDP's hooks eagerly"),
    ("privacy_unit", "a unit is not clipped as one across sharded calls yet"),
    ("offload_optimizer", "the optimizer state is sharded over the ranks already"),
    ("checkpointing", "the book-keeping engine keeps each layer's inputs itself"),
)


def check_shard(settings: Any) -> None:
    """Refuse ``--shard`` without ``torchrun`` and with what level 2 does not do.

    >>> from opake.cli._settings import TrainSettings
    >>> check_shard(TrainSettings(shard=True, engine="vmap"))
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: --shard with --engine vmap: ...
    """
    if not settings.shard:
        return
    from opake.cli._options import flag

    if settings.engine == "vmap":
        raise ConfigurationError(
            "--shard with --engine vmap: per-layer sharded compute runs the book-keeping "
            "engine (vmap needs the whole model per example); drop --engine or pass "
            "--engine bookkeeping"
        )
    for name, why in _REFUSED:
        if getattr(settings, name):
            raise ConfigurationError(f"--shard with --{flag(name)}: {why}; drop one of them")
    if settings.kernels not in ("auto", "none"):
        raise ConfigurationError(
            f"--shard with --kernels {settings.kernels}: the sharded model runs unpatched (the "
            "loss-only head holds per-example gradients per-layer sharded compute cannot "
            "bound); use --kernels none or auto"
        )
    if settings.sampler != "poisson":
        raise ConfigurationError("--shard with --sampler fixed: use --sampler poisson")
    if settings.microbatch == "auto":
        raise ConfigurationError(
            "--shard with --microbatch auto: the tuner measures the unsharded step; pass an "
            "integer --microbatch (or none: each rank's share of the batch at once)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 2:
        raise ConfigurationError(
            "--shard without torchrun: the model is sharded over the processes torchrun "
            "starts; run `torchrun --nproc-per-node N $(which opake) train --shard ...` with "
            "N >= 2 (or drop --shard to train in one process)"
        )


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: modules of the model's ``_no_split_modules`` classes."""
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: the model it wraps
    base: Any = get_base() if callable(get_base) else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigurationError(
            f"--shard: {type(base).__name__} names no decoder layer class "
            "(_no_split_modules); it cannot be sharded layer by layer: drop --shard"
        )
    return layers


def shard_model(plan: RunPlan, model: torch.nn.Module, ctx: Any) -> str:
    """``fully_shard`` every decoder layer and the root; returns the plan's ``sharded`` line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if plan.post is not None:
        raise ConfigurationError(
            "--shard with post-training records (SFT/DPO): not supported yet; train on text "
            "blocks, or drop --shard"
        )
    layers = _layers(model)
    kind = type(layers[0]).__name__  # fully_shard renames the class (FSDP<name>)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return (
        f"sharded   FSDP2 level 2 (per-layer sharded compute, book-keeping engine): "
        f"{ctx.world_size} ranks, units = {len(layers)} × {kind} + the root; the model runs "
        "unpatched"
    )


def sharded_loss(
    model: Any, forward_kwargs: dict[str, Any], autocast: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss(ids)``: the per-example causal-LM losses ``[B]`` of the sharded model."""
    from opake.dpsgd.bookkeeping import causal_lm_losses

    def loss(ids: torch.Tensor) -> torch.Tensor:
        with autocast():
            logits = model(input_ids=ids, **forward_kwargs).logits
        return causal_lm_losses(logits, ids)

    return loss


def full_model(plan: RunPlan, model: torch.nn.Module, is_main: bool) -> torch.nn.Module | None:
    """The trained model, unsharded, on rank 0 (``None`` elsewhere): every rank gathers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from opake.cli._setup import _build_model

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # a collective
    if not is_main:
        return None
    import torch

    copy: torch.nn.Module  # the model _build_model builds: a transformers (or PEFT) module
    _, copy, _ = _build_model(plan, torch.device("cpu"))
    copy.load_state_dict(state)
    return copy


def prepare_sharded(
    plan: RunPlan, ctx: Any, model: torch.nn.Module, forward_kwargs: dict[str, Any], autocast: Any
) -> dict[str, Any]:
    """The ``--shard`` run's own fields of the trainer's run record: the model sharded, its
    optimizer over the shards, the DP step (:func:`~opake.cli._dp_step.dp_training`) with
    ``shard=True``."""
    import sys

    from opake.cli._dp_step import dp_training
    from opake.cli._memory import MicrobatchChoice
    from opake.cli._setup import inner_optimizer

    s = plan.settings
    line = shard_model(plan, model, ctx)
    if ctx.is_main:
        print(line, file=sys.stderr, flush=True)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    inner = inner_optimizer(plan, model)
    micro = s.microbatch if isinstance(s.microbatch, int) else None
    loss = sharded_loss(model, forward_kwargs, autocast)
    training = dp_training(
        plan, loss, inner, trainable, module=model, microbatch_size=micro, shard=True
    )
    reason = f"microbatch {micro} per rank" if micro else "each rank's share of the batch at once"
    return {
        "trainable": trainable,
        "inner": inner,
        "training": training,
        "expected_zero": frozenset(),
        "microbatch": MicrobatchChoice(micro, f"--shard: {reason}"),
    }
