"""``sharded_clipped_grad``: check the configuration once, build the sharded ``grad_fn``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, unknown_keyword
from opake.dpsgd.bookkeeping._loss import BatchedLoss
from opake.dpsgd.bookkeeping._trust import trusted_names
from opake.dpsgd.clipping._api import _as_state, _check_settings, _checked_positions
from opake.dpsgd.clipping._base import ClipState
from opake.dpsgd.distributed.sharded._autograd import set_fsdp_reduction
from opake.dpsgd.distributed.sharded._grad_fn import ShardedClippedGradFn, _Engine
from opake.dpsgd.distributed.sharded._plan import mesh_group, sharded_plan, trainable
from opake.dpsgd.distributed.sharded._runner import ShardedRunner

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.clipping._base import GroupSpec

__all__ = ["sharded_clipped_grad"]


def _positions(batch_argnums: object) -> tuple[int, ...]:
    """The user's batch positions, checked, shifted past the (internal) parameter argument."""
    shifted: object = batch_argnums
    if isinstance(batch_argnums, int) and not isinstance(batch_argnums, bool):
        shifted = batch_argnums + 1 if batch_argnums >= 0 else batch_argnums
    elif isinstance(batch_argnums, tuple):
        shifted = tuple(
            b + 1 if isinstance(b, int) and not isinstance(b, bool) and b >= 0 else b
            for b in batch_argnums
        )
    try:
        return _checked_positions(0, shifted)[1]
    except ConfigurationError:
        raise ConfigurationError(
            f"sharded_clipped_grad(batch_argnums={batch_argnums!r}): expected a non-negative "
            "int or a non-empty tuple of distinct ones, the positions of loss_fn's batched "
            "arguments"
        ) from None


def sharded_clipped_grad(
    loss_fn: Callable[..., Any],
    model: torch.nn.Module,
    *,
    clipping_norm: float | Mapping[str, float] | ClipState,
    batch_argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    microbatch_size: int | None = None,
    normalize_by: float = 1.0,
    return_aux: bool = False,
    clipping_groups: GroupSpec = None,
    trusted_rules: tuple[str, ...] = (),
    **unknown: Any,
) -> tuple[ShardedClippedGradFn, ClipState]:
    """Build the per-layer sharded ``grad_fn`` for a ``fully_shard``-ed module (level 2).

    ``loss_fn(*batch)`` runs ``model`` itself on a batch and returns per-example losses ``[B]``
    (``(losses, aux)`` with ``has_aux``); entry ``i`` depends on example ``i`` only. The other
    options mean what they mean for :func:`~opake.dpsgd.clipping.clipped_grad`
    (``batch_argnums`` counts ``loss_fn``'s own arguments). Adaptive clipping and privacy units
    are not supported here. Every layer holding a trainable parameter needs a closed-form
    book-keeping rule (``linear``, ``embedding``, ``layer_norm``, ``rms_norm``, ``conv1d`` or a
    plugin's): otherwise :class:`~opake.core.errors.ConfigurationError`, here and at every call.
    FSDP's own gradient reduction is switched off on the module
    (``set_requires_gradient_sync(False)``): the clipped sums are reduce-scattered by
    :class:`~opake.dpsgd.distributed.ShardedDPOptimizer`, once per logical step. Only the
    per-example check's one backward through the module (on the first chunk and every
    ``RECHECK_EVERY`` chunks: plain autograd of one example) lets FSDP reduce, as a plain SUM
    (its gradient divide factor is set to 1, with SUM reductions forced), then switches it off
    again and puts the parameters' ``.grad`` back.

    Returns ``(grad_fn, state)``; see :class:`ShardedClippedGradFn`.

    >>> import torch
    >>> from opake.dpsgd.distributed import sharded_clipped_grad
    >>> net = torch.nn.Linear(2, 1)  # not fully_shard-ed
    >>> sharded_clipped_grad(lambda x: net(x)[:, 0], net, clipping_norm=1.0)
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: sharded_clipped_grad: the module has no DTensor ...
    """
    unknown_keyword("sharded_clipped_grad()", unknown, _options())
    if not callable(loss_fn):
        raise InputTypeError(
            f"sharded_clipped_grad(loss_fn={loss_fn!r}): expected a callable returning "
            "per-example losses [B]"
        )
    group = mesh_group(model)
    batch = _positions(batch_argnums)
    _check_settings(
        microbatch_size=microbatch_size,
        normalize_by=normalize_by,
        flags={"has_aux": has_aux, "return_aux": return_aux},
        randomness="error",
        compute_dtype=None,
    )
    state = _as_state(clipping_norm)
    if type(state).advance is not ClipState.advance:
        raise ConfigurationError(
            f"sharded_clipped_grad(clipping_norm={type(state).__name__}(...)): a clipping state "
            "that changes from step to step is not supported by per-layer sharded compute; "
            "use a fixed bound (a float or a mapping group → bound)"
        )
    if clipping_groups is not None and state.group_names() is None:
        raise ConfigurationError(
            "sharded_clipped_grad(clipping_groups=...) only applies to group clipping; pass "
            "clipping_norm as a mapping group → bound"
        )
    trusted = trusted_names(trusted_rules)
    sharded_plan(model, trainable(model), trusted=trusted)
    batched = BatchedLoss(lambda _params, *args: loss_fn(*args), model)
    runner = ShardedRunner(
        batched, argnums=0, batch_argnums=batch, has_aux=has_aux, trusted=trusted, group=group
    )
    engine = _Engine(
        batched.per_example(batch_argnums=batch, has_aux=has_aux),
        argnums=0,
        has_aux=has_aux,
        batch_argnums=batch,
        microbatch_size=microbatch_size,
        normalize_by=float(normalize_by),
        return_aux=return_aux,
        compute_dtype=None,
        clipping_groups=clipping_groups,
        randomness="error",
        kind=type(state),
        check_unused=False,
        requested_engine="bookkeeping",
        bookkeeping=runner,
        model=model,
    )
    set_fsdp_reduction(model, False)  # Opake reduce-scatters the clipped sums, once per step
    return ShardedClippedGradFn(engine, model, group, trusted), state


def _options() -> list[str]:
    """The keyword options of :func:`sharded_clipped_grad`, from its signature."""
    kinds = (inspect.Parameter.KEYWORD_ONLY,)
    return [
        p.name
        for p in inspect.signature(sharded_clipped_grad).parameters.values()
        if p.kind in kinds
    ]
