"""The clipped-gradient function a :class:`~opake.dpsgd.training.DPTraining` steps with: built
once (eager, compiled or sharded), then called once per physical batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError
from opake.dpsgd.training._compile import CompiledStep, check_compile
from opake.dpsgd.training._sharded import sharded_step

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.clipping import ClipAux, ClippedGradFn, ClipState

__all__ = ["build_clipping", "clipped_sum"]


def build_clipping(
    loss_fn: Callable[..., Any],
    clipping_norm: float | Mapping[str, float] | ClipState,
    *,
    engine: str,
    how: tuple[int | None, str, bool],
    units: object,
    layout: tuple[torch.nn.Module | None, int, int, object],
) -> tuple[ClippedGradFn, ClipState, CompiledStep | None]:
    """The clipped-gradient function, its clip state and (``compile=True``) the compiled step.

    ``how`` is ``(microbatch_size, randomness, compile)``; ``layout`` is ``(shard, number of
    fixed arguments, number of batched arguments, sampler)``: the batched arguments follow
    ``params`` and the fixed ones. A sharded step (``shard``) is called like a
    ``ClippedGradFn``; a compiled one runs chunks of one shape (the fixed sampler's ``B_max``,
    or ``microbatch_size``).
    """
    from opake.dpsgd.clipping import clipped_grad

    microbatch_size, randomness, compile = how
    shard, fixed, batched, sampler = layout
    if shard is not None:
        sharded, shard_state = sharded_step(loss_fn, shard, clipping_norm, microbatch_size, batched)
        return sharded, shard_state, None  # type: ignore[return-value]
    engine, rows, fullgraph = check_compile(
        compile,
        engine=engine,
        clipping_norm=clipping_norm,
        units=units,
        microbatch_size=microbatch_size,
        fixed_rows=getattr(sampler, "max_batch_size", None),
    )
    first = 1 + fixed
    grad_fn, state = clipped_grad(
        loss_fn,
        argnums=0,
        clipping_norm=clipping_norm,
        batch_argnums=tuple(range(first, first + batched)),
        microbatch_size=None if compile else microbatch_size,
        return_aux=True,
        randomness=randomness,
        engine=engine,
    )
    step = CompiledStep(grad_fn, rows or 1, fullgraph=fullgraph) if compile else None
    return grad_fn, state, step


def clipped_sum(
    fns: tuple[ClippedGradFn, CompiledStep | None],
    params: Mapping[str, torch.Tensor],
    args: tuple[Any, ...],
    batch: tuple[Any, ...],
    *,
    state: ClipState,
    example_mask: torch.Tensor | None,
    units: Any,
) -> tuple[Any, ClipAux, ClipState]:
    """One physical batch's clipped sum (no noise, the step not ended), its aux and the clip
    state after it; ``fns`` is ``(grad_fn, compiled step or None)``."""
    grad_fn, compiled = fns
    if compiled is not None:
        if units is not None:  # the compiled chunks would cut a unit's rows apart
            raise ConfigurationError(
                "accumulate(units=...) with compile=True: a unit's rows must be clipped as "
                "one, which the compiled chunks do not do; build DPTraining with "
                "compile=False to clip privacy units"
            )
        grads, aux, state = compiled(params, args, batch, state=state, example_mask=example_mask)
        return grads, aux, state
    kwargs: dict[str, Any] = {"end_step": False}
    if example_mask is not None:
        kwargs["example_mask"] = example_mask
    if units is not None:
        kwargs["units"] = units
    (grads, aux), state = grad_fn(params, *args, *batch, state=state, **kwargs)
    return grads, aux, state
