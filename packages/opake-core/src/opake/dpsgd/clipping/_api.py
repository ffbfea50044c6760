"""``clipped_grad``: check the configuration once, build the ``grad_fn``."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from opake.core.errors import ConfigurationError, InputTypeError, unknown_keyword
from opake.dpsgd.bookkeeping._loss import BatchedLoss
from opake.dpsgd.bookkeeping._trust import trusted_names
from opake.dpsgd.clipping._base import ClipState, GroupSpec
from opake.dpsgd.clipping._choice import prepare as prepare_engine
from opake.dpsgd.clipping._grad_fn import ClippedGradFn
from opake.dpsgd.clipping._state import FixedClipping, GroupClipping

if TYPE_CHECKING:
    import torch

__all__ = ["clipped_grad"]

_RANDOMNESS = ("error", "different", "same")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _engine_alias(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Accept ``method=``, the deprecated name of ``engine=`` (for one release), with a warning.

    A wrapper, so that :func:`clipped_grad`'s signature (and the accepted options it lists)
    keeps one name, and passing both names is caught even when ``engine`` has its default.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if "method" in kwargs:
            if "engine" in kwargs:
                raise ConfigurationError(
                    f"clipped_grad(engine={kwargs['engine']!r}, method={kwargs['method']!r}): "
                    "method= is the deprecated name of engine=; pass engine= only"
                )
            warnings.warn(
                "clipped_grad(method=...) is deprecated: pass clipped_grad(engine=...) (the same "
                "choice: 'auto', 'vmap' or 'bookkeeping'); method= will be removed in the next "
                "release",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs["engine"] = kwargs.pop("method")
        return fn(*args, **kwargs)

    return wrapper


def _options() -> tuple[str, ...]:
    """The keyword options of :func:`clipped_grad`, read from its signature."""
    params = inspect.signature(clipped_grad).parameters.values()
    return tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name != "loss_fn")


def _as_state(clipping_norm: object) -> ClipState:
    if isinstance(clipping_norm, ClipState):
        return clipping_norm
    if isinstance(clipping_norm, Mapping):
        return GroupClipping(clipping_norm)
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, int | float):
        raise InputTypeError(
            f"clipped_grad(clipping_norm={clipping_norm!r}): got a "
            f"{type(clipping_norm).__name__}; expected a positive float C, a mapping "
            "group → C (per-group bounds), AutoSClipping(...) or AdaptiveClipping(...)"
        )
    return FixedClipping(clipping_norm)


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"clipped_grad({name}={value!r}): expected a non-negative int position of a "
            "positional argument of loss_fn"
        )
    return value


def _checked_positions(argnums: object, batch_argnums: object) -> tuple[int, tuple[int, ...]]:
    """``argnums`` and ``batch_argnums`` (as a tuple), checked."""
    argnums = _check_index("argnums", argnums)
    batch: tuple[int, ...]
    if isinstance(batch_argnums, int):
        batch = (_check_index("batch_argnums", batch_argnums),)
    elif isinstance(batch_argnums, tuple) and batch_argnums:
        batch = tuple(_check_index("batch_argnums", b) for b in batch_argnums)
    else:
        raise ConfigurationError(
            f"clipped_grad(batch_argnums={batch_argnums!r}): expected an int or a non-empty "
            "tuple of ints"
        )
    if len(set(batch)) != len(batch) or argnums in batch:
        raise ConfigurationError(
            f"clipped_grad(argnums={argnums}, batch_argnums={batch_argnums!r}): positions must "
            "be distinct and the differentiated argument cannot be batched"
        )
    return argnums, batch


def _check_settings(
    *,
    microbatch_size: object,
    normalize_by: object,
    flags: dict[str, object],
    randomness: object,
    compute_dtype: object,
) -> None:
    """The remaining scalar options of :func:`clipped_grad`, checked."""
    if microbatch_size is not None and (
        isinstance(microbatch_size, bool)
        or not isinstance(microbatch_size, int)
        or microbatch_size < 1
    ):
        raise ConfigurationError(
            f"clipped_grad(microbatch_size={microbatch_size!r}): expected a positive int or None"
        )
    if (
        isinstance(normalize_by, bool)
        or not isinstance(normalize_by, int | float)
        or not (2.0**-64 <= float(normalize_by) <= 2.0**64)
    ):
        raise ConfigurationError(
            f"clipped_grad(normalize_by={normalize_by!r}): expected a positive number between "
            "2**-64 and 2**64 (e.g. the expected batch size); the fp32 sum is divided by it, and "
            "outside that range the division's rounding near fp32's limits would cost the "
            "clipping bound"
        )
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise InputTypeError(f"clipped_grad({flag}={value!r}): expected True or False")
    if randomness not in _RANDOMNESS:
        raise ConfigurationError(
            f"clipped_grad(randomness={randomness!r}): expected one of {_RANDOMNESS}"
        )
    if compute_dtype is not None:
        import torch

        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ConfigurationError(
                f"clipped_grad(compute_dtype={compute_dtype!r}): expected a floating torch.dtype "
                "such as torch.bfloat16, or None"
            )


@_engine_alias
def clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int = 0,
    has_aux: bool = False,
    *,
    clipping_norm: float | Mapping[str, float] | ClipState,
    batch_argnums: int | tuple[int, ...] = 1,
    microbatch_size: int | None = None,
    normalize_by: float = 1.0,
    return_aux: bool = False,
    compute_dtype: torch.dtype | None = None,
    clipping_groups: GroupSpec = None,
    randomness: str = "error",
    check_unused: bool = True,
    engine: str = "auto",
    trusted_rules: tuple[str, ...] = (),
    **unknown: Any,
) -> tuple[ClippedGradFn, ClipState]:
    """Build ``grad_fn``: the sum of per-example gradients, each clipped, in fp32.

    ``loss_fn(*args)`` computes the loss of **one** example: the arguments at ``batch_argnums``
    reach it without their batch dimension (through :func:`torch.func.vmap`), the others
    (parameters, frozen weights, constants) as given. ``grad_fn(*args, state=state)`` returns
    ``(grads, new_state)``: ``grads`` is a :class:`ClippedGrads` dict with the keys of
    ``args[argnums]`` holding ``Σ_i clip(∇ loss_fn(example i)) / normalize_by`` in fp32, and
    ``grads.max_norm`` its L2 sensitivity (the std of DP noise is ``σ · grads.max_norm``).
    A differentiated argument that is not a flat dict (a tensor, a tuple, a nested dict) gives
    ``grads`` of the same structure; its sensitivity is ``state.sensitivity / normalize_by``.

    Args:
        loss_fn: per-example loss; returns a scalar tensor, or ``(loss, aux)`` with ``has_aux``.
        argnums: position of the differentiated argument: a dict name → tensor (e.g.
            ``trainable`` from :func:`opake.functional.make_functional`) or any pytree of
            floating-point tensors (a lone tensor, a tuple, a nested dict), as for
            :func:`torch.func.grad`; ``grads`` then has the same structure.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (a pytree of tensors) is stacked
            over the batch into ``ClipAux.loss_aux``.
        clipping_norm: the clipping method — a float C (fixed), a mapping group → C_k
            (:class:`GroupClipping`, sensitivity ``sqrt(Σ C_k²)``), :class:`AutoSClipping` or
            :class:`AdaptiveClipping`. Also the initial ``state``.
        batch_argnums: position(s) of the batched arguments (tensors or pytrees of tensors
            whose first dimension is the batch).
        microbatch_size: process the batch in chunks of this many examples (the last may be
            smaller) with a running fp32 sum; same result, less memory. ``None``: one chunk.
        normalize_by: divide the sum by this (e.g. the expected batch size; between ``2**-64``
            and ``2**64``); the sensitivity is divided too.
        return_aux: return ``((grads, aux), new_state)`` with a :class:`ClipAux`
            (per-example losses and norms — not private).
        compute_dtype: run the per-example forward/backward in this dtype (every
            floating-point tensor argument is cast; one already in this dtype is not copied,
            so keep a large frozen model in it); norms, clipping and sums stay fp32.
        clipping_groups: for group clipping, parameter name → group: a mapping or a callable;
            by default a group name is a dotted prefix of the parameter names it covers
            (longest match wins, ``""`` matches everything).
        randomness: ``vmap`` randomness (``"different"`` for dropout in training mode).
        check_unused: on the first call, warn (:class:`~opake.core.errors.OpakePrivacyWarning`)
            about differentiated parameters the loss does not depend on (one extra
            single-example backward).
        engine: the per-example engine — ``"vmap"`` (per-example gradients by ``vmap``),
            ``"bookkeeping"`` (norms and the clipped sum from one ordinary batched backward;
            needs ``loss_fn`` to be a :class:`~opake.dpsgd.bookkeeping.BatchedLoss`, see
            :mod:`opake.dpsgd.bookkeeping`) or ``"auto"`` (book-keeping where every
            differentiated parameter has a rule and its first-call check passes, full
            fine-tuning and adapters such as LoRA alike; vmap otherwise, through its
            expanded forward when the differentiated parameters are at most a tenth of the
            rest of the model — counted from the arguments and, for a ``BatchedLoss``, its
            model, so frozen weights count however they reach the loss;
            ``grad_fn.engine``/``grad_fn.engine_reason`` report the choice, which is also
            logged on the ``opake.core`` logger). ``method=``, its former name, still works
            for one release with a :class:`DeprecationWarning`.
        trusted_rules: names of book-keeping rules (or operator classes) outside the clipping
            proof to use anyway: a plugin's rule whose per-example gradients an operator holds
            implicitly (Opake's own rules never need this). Untrusted, such a rule is skipped
            and its layers use the per-layer vmap rule (logged). ``OPAKE_TRUSTED_RULES``
            (comma-separated) adds names.

    Semantics: an example's gradient covers all differentiated leaves together. An example
    with a NaN/Inf gradient entry (or a norm beyond fp64 range) contributes zero and is
    counted in ``ClipAux.nonfinite_count``; the bound holds regardless. An empty batch gives
    zero gradients. The call runs under ``torch.no_grad()`` unless an outer ``torch.func``
    transform differentiates through it. Nothing mixes examples before clipping.
    ``grad_fn(..., units=ids)`` clips privacy units (a user's rows, a DPO pair) as wholes: each
    unit's summed gradient to C, same sensitivity (see :class:`ClippedGradFn`).

    Example:
        >>> import torch
        >>> from opake.dpsgd.clipping import clipped_grad
        >>> def loss_fn(params, x, y):  # one example: x [3], y []
        ...     return (params["w"] @ x - y) ** 2
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2))
        >>> params = {"w": torch.zeros(3)}
        >>> x, y = torch.ones(4, 3), torch.full((4,), 10.0)
        >>> grads, state = grad_fn(params, x, y, state=state)
        >>> grads["w"]  # four examples, each clipped from norm ≈ 34.6 to 1
        tensor([-2.3094, -2.3094, -2.3094])
        >>> grads.max_norm
        1.0
    """
    unknown_keyword("clipped_grad()", unknown, _options())
    if not callable(loss_fn):
        raise InputTypeError(
            f"clipped_grad(loss_fn={loss_fn!r}): expected a callable computing one example's loss"
        )
    argnums, batch = _checked_positions(argnums, batch_argnums)
    _check_settings(
        microbatch_size=microbatch_size,
        normalize_by=normalize_by,
        flags={"has_aux": has_aux, "return_aux": return_aux, "check_unused": check_unused},
        randomness=randomness,
        compute_dtype=compute_dtype,
    )
    model = loss_fn.module if isinstance(loss_fn, BatchedLoss) else None
    loss_fn, bookkeeping = prepare_engine(
        loss_fn,
        engine,
        argnums=argnums,
        batch_argnums=batch,
        has_aux=has_aux,
        trusted=trusted_names(trusted_rules),
    )
    state = _as_state(clipping_norm)
    if clipping_groups is not None and state.group_names() is None:
        raise ConfigurationError(
            "clipped_grad(clipping_groups=...) only applies to group clipping; pass "
            "clipping_norm as a mapping group → bound"
        )
    if clipping_groups is not None and not (
        isinstance(clipping_groups, Mapping) or callable(clipping_groups)
    ):
        raise InputTypeError(
            f"clipped_grad(clipping_groups={clipping_groups!r}): expected a mapping or callable "
            "parameter name → group name"
        )
    grad_fn = ClippedGradFn(
        loss_fn,
        argnums=argnums,
        has_aux=has_aux,
        batch_argnums=batch,
        microbatch_size=microbatch_size,
        normalize_by=float(normalize_by),
        return_aux=return_aux,
        compute_dtype=compute_dtype,
        clipping_groups=clipping_groups,
        randomness=randomness,
        kind=type(state),
        check_unused=check_unused,
        requested_engine=str(engine),
        bookkeeping=bookkeeping,
        model=model,
    )
    return grad_fn, state
