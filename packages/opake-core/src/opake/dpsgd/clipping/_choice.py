"""Which per-example engine ``clipped_grad`` uses: checked once, then chosen per call.

:func:`prepare` validates ``clipped_grad(engine=...)`` when ``grad_fn`` is built and makes the
book-keeping runner when it may run; :func:`choose` picks the engine of one call (the runner,
or ``None`` for the vmap engine) and says why. An explicit ``engine="bookkeeping"`` that cannot
run raises; ``"auto"`` falls back to vmap with the reason (logged by ``grad_fn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake.core.choices import ENGINES
from opake.core.errors import ConfigurationError
from opake.dpsgd.bookkeeping._loss import BatchedLoss
from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = ["choose", "prepare"]


def prepare(
    loss_fn: Any,
    engine: object,
    *,
    argnums: int,
    batch_argnums: tuple[int, ...],
    has_aux: bool,
    trusted: frozenset[str] = frozenset(),
) -> tuple[Callable[..., Any], BookkeepingRunner | None]:
    """Validate ``clipped_grad(engine=...)``; return the one-example loss and the runner."""
    if engine not in ENGINES:
        raise ConfigurationError(
            f"clipped_grad(engine={engine!r}): expected one of {ENGINES} ('auto' uses "
            "book-keeping where it is exact, vmap otherwise)"
        )
    if not isinstance(loss_fn, BatchedLoss):
        if engine == "bookkeeping":
            raise ConfigurationError(
                f"clipped_grad(engine='bookkeeping') needs a BatchedLoss (per-example losses of "
                f"a whole batch, and the model it runs); got {loss_fn!r}. Wrap it: "
                "BatchedLoss(fn, fmodel) from opake.dpsgd.bookkeeping, or use engine='vmap'"
            )
        return loss_fn, None
    per_example = loss_fn.per_example(batch_argnums=batch_argnums, has_aux=has_aux)
    if engine == "vmap":
        return per_example, None
    runner = BookkeepingRunner(
        loss_fn, argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux, trusted=trusted
    )
    return per_example, runner


def choose(
    runner: BookkeepingRunner | None,
    engine: str,
    names: tuple[str, ...],
    *,
    differentiable: bool,
    randomness: str,
    units: bool = False,
) -> tuple[BookkeepingRunner | None, str]:
    """Pick the engine for one call: ``(runner or None, reason)``; explicit requests are loud.

    ``units``: the call groups rows into privacy units, which a model whose pieces cannot be
    regrouped per unit (``runner.units_refused``, found on an earlier unit call) clips on the
    vmap engine.

    Adapters (LoRA) take book-keeping like any other parameters: on the DP-step benchmark it
    is the faster engine there too (see ``docs/guide/bookkeeping.md``).
    """
    if runner is None:
        return None, (
            "engine='vmap'"
            if engine == "vmap"
            else "loss_fn is a one-example loss (wrap a batched loss in BatchedLoss for "
            "book-keeping)"
        )
    if runner.disabled is not None:
        return None, runner.disabled
    why = None
    if differentiable:
        why = "an outer torch.func transform differentiates through grad_fn"
    elif units and runner.units_refused is not None:
        why = runner.units_refused
    elif randomness != "error":
        # the check that one example's book-keeping gradient equals its own autograd gradient
        # is what keeps a loss that mixes examples out; random layers draw other masks in it
        why = (
            f"randomness={randomness!r} (random layers): the per-example check cannot run, "
            "and without it a loss that mixes examples would go unnoticed (use engine='auto' "
            "or 'vmap' for per-example random masks, or turn the random layers off)"
        )
    else:
        plan = runner.plan(names)
        if not plan.supported:
            why = "no book-keeping rule for: " + "; ".join(
                f"{what} ({reason})" for what, reason in plan.unsupported
            )
    if why is None:
        return runner, "book-keeping: every differentiated parameter has a rule"
    if engine == "bookkeeping":
        raise ConfigurationError(f"clipped_grad(engine='bookkeeping'): {why}")
    return None, why
