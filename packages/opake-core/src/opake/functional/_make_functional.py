"""Implementation of :func:`opake.functional.make_functional` (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from opake.core.errors import ConfigurationError, InputTypeError, suggest

if TYPE_CHECKING:
    from typing import Literal

    import torch

__all__ = ["FunctionalModel", "make_functional"]

ParamDicts = Mapping[str, "torch.Tensor"] | Sequence[Mapping[str, "torch.Tensor"]]


class FunctionalModel:
    """A stateless view of a module: ``fmodel(params, *args, **kwargs)`` runs it with ``params``.

    ``params`` is one mapping from parameter name to tensor, or a sequence of such mappings
    that together cover every parameter exactly once — ``fmodel((trainable, frozen), x)`` is the
    same as ``fmodel({**frozen, **trainable}, x)`` without building the merged dict. Every
    parameter of the module (tied parameters once, under their first name) must be given; a
    missing or unknown name raises :class:`~opake.core.errors.ConfigurationError`. Buffers
    (running statistics, rotary ``inv_freq`` …) are read from the module at call time; a buffer
    name may also be given in ``params`` to override it for this call.

    The call goes through :func:`torch.func.functional_call` with ``tie_weights=True``, so it
    composes with :func:`torch.func.vmap`, :func:`torch.func.grad` and :func:`torch.func.vjp`.
    """

    __slots__ = ("_buffer_names", "_module", "_param_names")

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._param_names = tuple(name for name, _ in module.named_parameters())
        self._buffer_names = frozenset(name for name, _ in module.named_buffers())

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (its own parameters are never used by a call)."""
        return self._module

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every parameter name a call needs, in ``module.named_parameters()`` order."""
        return self._param_names

    def _merge(self, params: ParamDicts) -> dict[str, torch.Tensor]:
        if isinstance(params, Mapping):
            parts: Sequence[Mapping[str, torch.Tensor]] = (params,)
        elif isinstance(params, Sequence) and all(isinstance(p, Mapping) for p in params):
            parts = params
        else:
            raise InputTypeError(
                f"fmodel(params, ...): params is a {type(params).__name__}; expected a mapping "
                "from parameter name to tensor, or a tuple of such mappings (e.g. "
                "(trainable, frozen)) as returned by make_functional"
            )
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, value in part.items():
                if name in merged:
                    raise ConfigurationError(
                        f"fmodel(params, ...): parameter {name!r} is given twice; pass each "
                        "parameter in exactly one of the mappings"
                    )
                merged[name] = value
        missing = [n for n in self._param_names if n not in merged]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ConfigurationError(
                f"fmodel(params, ...): missing parameter(s) {shown}{more}; pass every parameter "
                "(with partition_trainable=True, pass both dicts: fmodel((trainable, frozen), ...))"
            )
        if len(merged) != len(self._param_names):
            known = set(self._param_names)
            for name in merged:
                if name not in known and name not in self._buffer_names:
                    raise ConfigurationError(
                        f"fmodel(params, ...): {name!r} is not a parameter or buffer of "
                        f"{type(self._module).__name__}{suggest(name, known)}; pass the names "
                        "returned by make_functional"
                    )
        return merged

    def __call__(self, params: ParamDicts, /, *args: Any, **kwargs: Any) -> Any:
        """Run the module with ``params`` instead of its own parameters."""
        # Any: whatever the module's forward returns (torch types Module.__call__ so too)
        from torch.func import functional_call

        merged = self._merge(params)
        return functional_call(self._module, merged, args, kwargs, tie_weights=True)

    def __repr__(self) -> str:
        return (
            f"FunctionalModel({type(self._module).__name__}, {len(self._param_names)} parameters)"
        )


@overload
def make_functional(
    model: torch.nn.Module, partition_trainable: Literal[False] = ..., **options: Any
) -> tuple[FunctionalModel, dict[str, torch.Tensor]]: ...


@overload
def make_functional(
    model: torch.nn.Module, partition_trainable: Literal[True], **options: Any
) -> tuple[FunctionalModel, dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


def make_functional(
    model: torch.nn.Module, partition_trainable: bool = False, **options: Any
) -> (
    tuple[FunctionalModel, dict[str, torch.Tensor]]
    | tuple[FunctionalModel, dict[str, torch.Tensor], dict[str, torch.Tensor]]
):
    """Split ``model`` into a stateless callable and its parameters.

    Args:
        model: any :class:`torch.nn.Module` — plain PyTorch, Hugging Face, or PEFT-wrapped.
        partition_trainable: when true, return the parameters as two dicts split on
            ``requires_grad``: ``trainable`` (the only ones that get per-example gradients, e.g.
            LoRA adapters) and ``frozen``.
        **options: none are accepted yet; any keyword raises ``ConfigurationError``.

    Returns:
        ``(fmodel, params)``, or ``(fmodel, trainable, frozen)`` with ``partition_trainable=True``.
        The dicts map parameter names (as in ``model.named_parameters()``; a tied parameter
        appears once, under its first name) to detached tensors that *share storage* with the
        module's parameters: an in-place optimizer step on the module is seen by the dicts and
        vice versa. ``fmodel(params, *args, **kwargs)`` runs the module with a parameter dict
        (or a tuple of dicts such as ``(trainable, frozen)``); see :class:`FunctionalModel`.

    Example:
        >>> import torch
        >>> from opake.functional import make_functional
        >>> model = torch.nn.Linear(3, 2)
        >>> _ = model.bias.requires_grad_(False)
        >>> fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        >>> sorted(trainable), sorted(frozen)
        (['weight'], ['bias'])
        >>> x = torch.ones(1, 3)
        >>> torch.equal(fmodel((trainable, frozen), x), model(x))
        True
    """
    import torch

    if options:
        name = next(iter(options))
        raise ConfigurationError(
            f"make_functional() got an unknown keyword argument {name!r}; the accepted "
            "arguments are model and partition_trainable"
        )
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(
            f"make_functional(model): model is a {type(model).__name__}; expected a "
            "torch.nn.Module (a plain, Hugging Face or PEFT model)"
        )
    if not isinstance(partition_trainable, bool):
        raise InputTypeError(
            f"make_functional(partition_trainable={partition_trainable!r}): expected True or False"
        )
    _refuse_sharded(model)
    fmodel = FunctionalModel(model)
    named = list(model.named_parameters())
    if not partition_trainable:
        return fmodel, {name: p.detach() for name, p in named}
    trainable = {name: p.detach() for name, p in named if p.requires_grad}
    frozen = {name: p.detach() for name, p in named if not p.requires_grad}
    return fmodel, trainable, frozen


def _refuse_sharded(model: torch.nn.Module) -> None:
    """A ``fully_shard``-ed module (DTensor parameters) gathers and swaps in its own parameters
    in its forward, overriding the ones a functional call passes: per-example gradients
    through it would be silently wrong."""
    import torch

    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigurationError(
            "make_functional(model): the model is fully_shard-ed (FSDP2, DTensor parameters); "
            "its forward gathers and swaps in its own parameters, overriding the ones passed, "
            "so per-example gradients through it would be silently wrong. Use "
            "compute_template(model) made before fully_shard with gather_full_params (level "
            "1), or sharded_clipped_grad (level 2), from opake.dpsgd.distributed"
        )
