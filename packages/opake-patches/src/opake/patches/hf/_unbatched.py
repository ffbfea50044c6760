"""Unbatched per-example calls: ``model(input_ids[T], labels=labels[T])`` under ``vmap``.

Inside ``vmap`` each example arrives without its batch dimension, and Hugging Face models only
take batches (a 1-D ``input_ids`` fails deep inside the model, e.g. GPT-2's "too many indices
for tensor of dimension 1"). A patched model's ``forward`` therefore recognises a *one-example*
call — ``input_ids`` with one dimension (``(T,)``), or, without ``input_ids``, ``inputs_embeds``
with two (``(T, H)``) — adds the batch dimension to every per-example argument
(:data:`UNBATCHED_RANKS`), runs the batched forward on a batch of one, and removes the batch
dimension from the outputs that carry one (:data:`BATCHED_OUTPUTS`). Hugging Face models never
take a 1-D ``input_ids`` otherwise, so the two call shapes cannot be confused; a batched call
(2-D ``input_ids``, ``x[None]`` included) goes to the model untouched.

The unbatched call is exactly the ``[None]`` call: the same operations on the same tensors, so
values and gradients are identical (under ``vmap(grad(...))``, gradient checkpointing and
``save_on_cpu`` as well). What the output holds:

* ``loss`` — a scalar, as for a batch of one (with ``per_example_loss=True``: a scalar instead
  of ``(1,)``);
* ``logits`` ``(T, V)`` (``(num_labels,)`` for a classifier), ``hidden_states`` and
  ``attentions`` per layer, ``last_hidden_state``, ``pooler_output``: without the batch
  dimension;
* everything else as the model computes it for a batch of one (a mixture of experts'
  ``router_logits`` are ``(T, experts)`` already; ``aux_loss`` is a scalar).

A KV cache is a decoding-time object with its own batch dimension: an unbatched call builds
none (``use_cache=False`` is passed where the forward takes it) and refuses ``use_cache=True``
or a cache argument. An argument whose rank does not fit an unbatched call (a 2-D
``attention_mask`` beside a 1-D ``input_ids``) raises
:class:`~opake.core.errors.ConfigurationError` naming both fixes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.patches._patcher import tag

if TYPE_CHECKING:
    from opake.patches._patcher import Patcher

__all__ = ["BATCHED_OUTPUTS", "UNBATCHED_RANKS", "install_unbatched_calls", "is_unbatched_call"]

#: per-example argument → the ranks it may have in an unbatched call (its batched rank minus
#: one): a padding mask ``(T,)`` or a float mask ``(1, T, T)``; token labels ``(T,)`` or a
#: classifier's label ``()`` (multi-label: ``(num_labels,)``)
_RANKS: dict[str, tuple[int, ...]] = {
    "input_ids": (1,),
    "inputs_embeds": (2,),
    "attention_mask": (1, 3),
    "labels": (0, 1),
    "shift_labels": (1,),
    "position_ids": (1,),
    "token_type_ids": (1,),
    "encoder_hidden_states": (2,),
    "encoder_attention_mask": (1, 3),
}
UNBATCHED_RANKS: Mapping[str, tuple[int, ...]] = MappingProxyType(_RANKS)
# (the forward reads _RANKS: torch.compile graph-breaks on reading a mappingproxy once the
# traced code has mutated any dict, as the forward does with its keyword arguments)
#: output fields whose leading dimension is the batch (a tuple field: each of its tensors)
BATCHED_OUTPUTS: tuple[str, ...] = (
    "logits",
    "last_hidden_state",
    "pooler_output",
    "hidden_states",
    "attentions",
    "cross_attentions",
)
#: cache arguments (transformers >= 5.2x calls it ``cache``; earlier ``past_key_values``)
_CACHES = ("cache", "past_key_values")


def _rank(value: Any) -> int | None:
    import torch

    # isinstance, not callable(value.dim): torch.compile traces it
    return value.dim() if isinstance(value, torch.Tensor) else None


def is_unbatched_call(input_ids: Any, inputs_embeds: Any = None) -> bool:
    """Whether a forward call carries one example without its batch dimension.

    ``input_ids`` of shape ``(T,)``; without ``input_ids``, ``inputs_embeds`` of ``(T, H)``.

    >>> import torch
    >>> is_unbatched_call(torch.ones(5, dtype=torch.long))
    True
    >>> is_unbatched_call(torch.ones(1, 5, dtype=torch.long)), is_unbatched_call(None, torch.ones(5, 8))
    (False, True)
    """  # noqa: E501 - doctest output
    if input_ids is not None:
        return _rank(input_ids) == 1
    return _rank(inputs_embeds) == 2


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(tuple(shape)) if shape is not None else type(value).__name__


def _check(name: str, value: Any, ids_name: str, ids: Any) -> None:
    """Refuse an argument that does not fit an unbatched call (the message names both fixes)."""
    rank = _rank(value)
    if rank is None:
        raise InputTypeError(
            f"model({ids_name} of shape {_shape(ids)}, {name}=...): an unbatched call (one "
            f"example without its batch dimension, as under vmap) takes {name} as a tensor, got "
            f"{type(value).__name__}. Pass a tensor, or call the model with a batch "
            f"({ids_name}[None] and batched arguments)."
        )
    ranks = _RANKS[name]
    if rank not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ConfigurationError(
            f"model({ids_name} of shape {_shape(ids)}, {name} of shape {_shape(value)}): "
            f"{ids_name} has no batch dimension (one example, as under vmap), so {name} must "
            f"have none either ({expected} dimension(s)). Drop its batch dimension "
            f"({name}[0] for a batch of one), or pass a batch everywhere ({ids_name}[None])."
        )


def _drop_batch(value: Any) -> object:
    if isinstance(value, (tuple, list)):
        return type(value)(_drop_batch(v) for v in value)
    rank = _rank(value)
    if rank is None or rank == 0 or value.shape[0] != 1:
        return value
    return value.squeeze(0)


def _unbatch_outputs(out: object, *, per_example_loss: bool) -> object:
    """Remove the batch dimension of a batch-of-one output (a ``ModelOutput``, in place)."""
    if not isinstance(out, MutableMapping):
        return out
    for name in BATCHED_OUTPUTS:
        value = out.get(name)
        if value is not None:
            out[name] = _drop_batch(value)
    loss = out.get("loss")
    if per_example_loss and _rank(loss) == 1:
        out["loss"] = _drop_batch(loss)
    return out


def install_unbatched_calls(model: Any, patcher: Patcher) -> None:
    """Wrap ``model.forward`` (this instance only) so a one-example call without its batch
    dimension runs as a batch of one (see the module docstring); batched calls pass through
    untouched.

    Install it last: it is the outermost wrapper, so the mask conversion and the loss-only
    forward see the batched call.
    """
    inner = model.forward
    try:
        signature = inspect.signature(inner)
    except (TypeError, ValueError):  # pragma: no cover - exotic forwards
        signature = None
    params = signature.parameters if signature is not None else {}
    positional = [
        name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    index = {name: i for i, name in enumerate(positional)}
    takes_cache_flag = "use_cache" in params

    # Any: the caller's argument, a tensor or not (checked where it must be one)
    def get(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = index.get(name)
        return args[i] if i is not None and i < len(args) else None

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> object:
        input_ids = get(args, kwargs, "input_ids")
        if not is_unbatched_call(input_ids, get(args, kwargs, "inputs_embeds")):
            return inner(*args, **kwargs)
        ids_name = "input_ids" if input_ids is not None else "inputs_embeds"
        ids = get(args, kwargs, ids_name)
        if get(args, kwargs, "use_cache"):
            raise ConfigurationError(
                f"model({ids_name} of shape {_shape(ids)}, use_cache=True): an unbatched call "
                "(one example, as under vmap) builds no KV cache — a cache keeps its batch "
                "dimension. Drop use_cache=True, or call with a batch "
                f"({ids_name}[None]) to decode with a cache."
            )
        for cache in _CACHES:
            if get(args, kwargs, cache) is not None:
                raise ConfigurationError(
                    f"model({ids_name} of shape {_shape(ids)}, {cache}=...): an unbatched call "
                    "(one example, as under vmap) takes no KV cache — a cache keeps its batch "
                    f"dimension. Call with a batch ({ids_name}[None]) to decode with a cache."
                )
        new_args = list(args)

        def put(name: str, value: Any) -> None:
            i = index.get(name)
            if name not in kwargs and i is not None and i < len(new_args):
                new_args[i] = value
            else:
                kwargs[name] = value

        for name in _RANKS:
            value = get(args, kwargs, name)
            if value is not None:
                _check(name, value, ids_name, ids)
                put(name, value.unsqueeze(0))
        if takes_cache_flag and get(args, kwargs, "use_cache") is None:
            put("use_cache", False)
        wanted = kwargs.get("return_dict")
        if wanted is None:
            wanted = getattr(getattr(model, "config", None), "return_dict", True)
        if wanted is False:  # read the fields by name, then give the tuple asked for
            kwargs["return_dict"] = True
        out = _unbatch_outputs(
            inner(*new_args, **kwargs), per_example_loss=bool(kwargs.get("per_example_loss"))
        )
        if wanted is False:
            to_tuple = getattr(out, "to_tuple", None)
            if callable(to_tuple):
                return to_tuple()
        return out

    tag(forward, "_opake_stage", "unbatched_calls")
    patcher.set_attr(model, "forward", forward)
