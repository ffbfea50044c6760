"""Conformance checks of the patched model's behaviour: activation checkpointing, LoRA,
dropout, reversibility, instance-only patching."""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

from opake.models._apply import unwrap_model
from opake.models.testing._case import (
    ConformanceCase,
    ConformanceError,
    _batch_args,
    _check_factory,
    _first_layer_linears,
    _fresh,
    _inputs,
    _loss_fn,
    _patch,
    _snapshot,
    _task,
    _unpatch,
    _vmapped_grads,
    _zero_dropout,
)
from opake.models.testing._checks_grads import (
    _clipped_sum_check,
)

__all__ = [
    "check_checkpointing",
    "check_dropout",
    "check_instance_only",
    "check_lora",
    "check_reversible",
]


def _count_inner_calls(model: Any, layer_class: str) -> tuple[dict[str, int], list[Any]]:
    """Count calls of every module inside the ``layer_class`` layers (hooks on the layers
    themselves would not see a recomputation: transformers checkpoints ``forward``)."""
    counts = {"calls": 0}

    def hook(*_: Any) -> None:
        counts["calls"] += 1

    handles = [
        inner.register_forward_pre_hook(hook)
        for module in model.modules()
        if type(module).__name__ == layer_class
        for inner in module.modules()
        if inner is not module
    ]
    return counts, handles


def check_checkpointing(case: ConformanceCase) -> None:
    """``gradient_checkpointing_enable()`` on the patched model: the layers are recomputed in
    the backward pass (twice the inner calls), and the clipped gradients still equal the
    (un-checkpointed) loop's."""
    import warnings

    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    inputs = _inputs(case, stock)
    for model in (stock, patched):
        _zero_dropout(model)
        model.train()
    _patch(patched, case)
    layer = _layer_class(case, unwrap_model(patched))
    loss_only = _task(patched) == "causal_lm"
    counts, handles = _count_inner_calls(patched, layer)
    _vmapped_grads(patched, inputs, loss_only=loss_only)
    plain = counts["calls"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renaming notice
        # a Hugging Face model: apply_model_patches took it (it patches no other)
        cast("_Checkpointable", patched).gradient_checkpointing_enable()
    counts["calls"] = 0
    _vmapped_grads(patched, inputs, loss_only=loss_only)
    for handle in handles:
        handle.remove()
    if plain == 0 or counts["calls"] != 2 * plain:
        raise ConformanceError(
            f"gradient checkpointing did not recompute the {layer} layers once: "
            f"{counts['calls']} inner module calls with it, {plain} without (expected twice)"
        )
    _clipped_sum_check(case, stock, patched, inputs, what="checkpointed clipped gradient sum")


class _Checkpointable(Protocol):
    """A Hugging Face model's ``gradient_checkpointing_enable`` (unannotated there)."""

    def gradient_checkpointing_enable(self) -> None: ...


def _layer_class(case: ConformanceCase, model: Any) -> str:
    """The checkpoint-boundary class (see :attr:`ConformanceCase.layer_class`)."""
    if case.layer_class is not None:
        return case.layer_class
    report = vars(model).get("_opake_family_report")
    layer = getattr(report, "layer", None)
    if isinstance(layer, str):
        return layer
    no_split = sorted(getattr(model, "_no_split_modules", None) or ())
    if len(no_split) != 1:
        raise ConformanceError(
            f"cannot tell the decoder-layer class of {type(model).__name__} (transformers lists "
            f"{no_split} in _no_split_modules); pass ConformanceCase(layer_class=...)."
        )
    return str(no_split[0])


def check_lora(case: ConformanceCase) -> None:
    """A PEFT LoRA model of the family, patched after wrapping, with
    ``make_functional(partition_trainable=True)``: clipped adapter gradients equal the loop's."""
    from opake.core.testing import with_lora

    _check_factory(case)
    base = _fresh(case)
    targets = case.lora_targets or _first_layer_linears(base)
    stock = with_lora(base, target_modules=targets)
    patched = with_lora(_fresh(case), target_modules=targets)
    inputs = _inputs(case, stock)
    _patch(patched, case)
    _clipped_sum_check(
        case, stock, patched, inputs, what="LoRA clipped gradient sum", partition_trainable=True
    )


def check_dropout(case: ConformanceCase) -> None:
    """Training mode (dropout on) under ``vmap(randomness="different")`` runs, stays finite,
    and every example's clipped gradient respects the bound."""
    import torch

    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    model = _fresh(case)
    inputs = _inputs(case, model)
    model.train()
    _patch(model, case)
    fmodel, params = make_functional(model)
    loss = _loss_fn(fmodel, _task(model), loss_only=_task(model) == "causal_lm")
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1e-3, batch_argnums=(1, 2, 3), randomness="different", return_aux=True
    )
    (grads, aux), _ = grad_fn(params, *_batch_args(inputs), state=state)
    if not all(bool(torch.isfinite(v).all()) for v in grads.values()):
        raise ConformanceError("training-mode clipped gradients are not finite")
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in grads.values()))
    if norm > case.batch * 1e-3 * (1 + 1e-4):
        raise ConformanceError(f"clipped sum norm {norm} exceeds batch × C")
    if float(aux.clipped_grad_norms.max()) > 1e-3 * (1 + 1e-4):
        raise ConformanceError("an example's clipped gradient norm exceeds C")


def check_reversible(case: ConformanceCase) -> None:
    """``remove_model_patches`` restores the instance exactly (attributes and outputs)."""
    import torch

    _check_factory(case)
    model = _fresh(case)
    inputs = _inputs(case, model)
    before = _snapshot(model)
    with torch.no_grad():
        expected = model(**inputs).logits
    _patch(model, case)
    _unpatch(model)
    after = _snapshot(model)
    if before["instance"] != after["instance"]:
        changed = [k for k in before["instance"] if before["instance"][k] != after["instance"][k]]
        raise ConformanceError(f"attributes left behind on modules {changed[:5]} after removal")
    with torch.no_grad():
        got = model(**inputs).logits
    if not torch.equal(got, expected):
        raise ConformanceError("outputs differ from the stock model after removing the patches")


def check_instance_only(case: ConformanceCase) -> None:
    """Patching one instance changes no transformers class and no other instance."""
    import torch

    _check_factory(case)
    model, other = _fresh(case), _fresh(case)
    inputs = _inputs(case, model)
    before = _snapshot(other)
    with torch.no_grad():
        expected = other(**inputs).logits
    _patch(model, case)
    after = _snapshot(other)
    if before["classes"] != after["classes"]:
        changed = [k for k in before["classes"] if before["classes"][k] != after["classes"][k]]
        raise ConformanceError(f"patching one instance modified classes {changed[:5]}")
    if before["instance"] != after["instance"]:
        raise ConformanceError("patching one instance modified another instance")
    with torch.no_grad():
        if not torch.equal(other(**inputs).logits, expected):
            raise ConformanceError("an unpatched instance's outputs changed")
    _unpatch(model)
