"""Conformance checks of outputs and gradients: registration, outputs, the loss-only head,
per-example and clipped gradients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
from opake.models.testing._case import (
    ConformanceCase,
    ConformanceError,
    _batch_args,
    _check_factory,
    _fresh,
    _inputs,
    _loss_fn,
    _patch,
    _reference,
    _stack,
    _task,
    _vmapped_grads,
    assert_grads_close,
)

__all__ = [
    "check_clipped_grads",
    "check_loss_only",
    "check_outputs_match",
    "check_per_example_grads",
    "check_registered",
    "check_unbatched_calls",
]

#: how close an unbatched call must be to its ``[None]`` twin (the same operations on the same
#: tensors: equal on the CPU; the margin only absorbs a device's non-deterministic kernels)
UNBATCHED_RTOL = 1e-6


def check_registered(case: ConformanceCase) -> None:
    """The model's ``config.model_type`` is claimed by an installed family that supports it."""
    from opake.core.plugins import model_families

    model = _fresh(case)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    families = model_families()
    if model_type not in families:
        raise ConformanceError(
            f"no installed model family claims model_type {model_type!r}; registered: "
            f"{sorted(families)}. Is the plugin's entry point in group 'opake' installed?"
        )
    ok, reason = families[model_type].supported()
    if not ok:
        raise ConformanceError(f"family {families[model_type].name!r} is not supported: {reason}")


def check_outputs_match(case: ConformanceCase) -> None:
    """Patched outputs (logits, loss) equal the unpatched model's on a padded batch."""
    import torch

    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    inputs = _inputs(case, stock)
    _patch(patched, case)
    with torch.no_grad():
        expected = stock(**inputs)
        got = patched(**inputs)
    assert_grads_close(
        "logits",
        {"logits": got.logits, "loss": got.loss},
        {"logits": expected.logits, "loss": expected.loss},
        case.rtol,
    )


def check_loss_only(case: ConformanceCase) -> None:
    """``loss_only=True`` returns ``logits=None`` and each example's stock loss."""
    import torch

    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    if _task(stock) != "causal_lm":
        return  # a classifier has no vocabulary projection: nothing to fuse
    inputs = _inputs(case, stock)
    _patch(patched, case)
    got, expected = [], []
    with torch.no_grad():
        for i in range(case.batch):
            one = {k: v[i : i + 1] for k, v in inputs.items()}
            out = patched(**one, loss_only=True, use_cache=False)
            if out.logits is not None:
                raise ConformanceError("loss_only=True returned logits; expected logits=None")
            got.append(out.loss)
            expected.append(stock(**one, use_cache=False).loss)
            if patched(**one, use_cache=False).logits is None:
                raise ConformanceError("a call without loss_only=True lost its logits")
    assert_grads_close(
        "loss_only losses",
        {"loss": torch.stack(got)},
        {"loss": torch.stack(expected)},
        case.rtol,
    )


def check_per_example_grads(case: ConformanceCase) -> None:
    """Per-example gradients under ``vmap`` (2-D padded masks, loss-only) equal the loop's."""
    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    inputs = _inputs(case, stock)
    expected, losses = _reference(case, stock, inputs)
    _patch(patched, case)
    import torch

    loss_only = _task(patched) == "causal_lm"
    grads, got_losses = _vmapped_grads(patched, inputs, loss_only=loss_only)
    assert_grads_close(
        "per-example losses", {"loss": got_losses}, {"loss": torch.stack(losses)}, case.rtol
    )
    assert_grads_close("per-example gradients", grads, _stack(expected), case.rtol)


def _clip_norm(per_example: Sequence[Mapping[str, torch.Tensor]]) -> float:
    norms = sorted(
        math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values())) for g in per_example
    )
    return norms[len(norms) // 2]  # the median: some examples are clipped, some are not


def _clipped_sum_check(
    case: ConformanceCase,
    stock: Any,
    patched: Any,
    inputs: Mapping[str, torch.Tensor],
    *,
    what: str,
    partition_trainable: bool = False,
    randomness: str = "error",
) -> None:
    from opake.core.testing import per_example_grads_loop, reference_clipped_sum
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    task = _task(stock)
    if partition_trainable:
        ref_fmodel, *ref_params = make_functional(stock, partition_trainable=True)
        fmodel, *params = make_functional(patched, partition_trainable=True)
    else:
        ref_fmodel, *ref_params = make_functional(stock)
        fmodel, *params = make_functional(patched)
    ref_loss = _loss_fn(ref_fmodel, task, loss_only=False)
    loss = _loss_fn(fmodel, task, loss_only=task == "causal_lm")
    if partition_trainable:
        ref_trainable, ref_frozen = ref_params
        trainable, frozen = params

        def ref_fn(p: Any, *batch: torch.Tensor) -> torch.Tensor:
            return ref_loss((p, ref_frozen), *batch)

        def fn(p: Any, *batch: torch.Tensor) -> torch.Tensor:
            return loss((p, frozen), *batch)

        ref_args, args = ref_trainable, trainable
    else:
        ref_fn, fn = ref_loss, loss
        ref_args, args = ref_params[0], params[0]
    per_example, _ = per_example_grads_loop(
        ref_fn, (ref_args, *_batch_args(inputs)), batch_argnums=(1, 2, 3)
    )
    clip = _clip_norm(per_example)
    expected = reference_clipped_sum(per_example, clipping_norm=clip)
    grad_fn, state = clipped_grad(
        fn,
        clipping_norm=clip,
        batch_argnums=(1, 2, 3),
        microbatch_size=2,
        randomness=randomness,
    )
    got, _ = grad_fn(args, *_batch_args(inputs), state=state)
    assert_grads_close(what, dict(got), expected, case.rtol)


def check_clipped_grads(case: ConformanceCase) -> None:
    """``clipped_grad`` on the patched model (microbatches of 2) equals the clipped loop."""
    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    inputs = _inputs(case, stock)
    _patch(patched, case)
    _clipped_sum_check(case, stock, patched, inputs, what="clipped gradient sum")


def check_unbatched_calls(case: ConformanceCase) -> None:
    """An unbatched one-example call (1-D ``input_ids``, mask and labels, as under ``vmap``)
    equals the ``[None]`` call: outputs without the batch dimension, the same losses and
    per-example gradients under ``vmap(grad)`` — which equal the loop's."""
    import torch

    _check_factory(case)
    stock, patched = _fresh(case), _fresh(case)
    inputs = _inputs(case, stock)
    expected, losses = _reference(case, stock, inputs)
    _patch(patched, case)
    causal = _task(patched) == "causal_lm"
    with torch.no_grad():
        for i in range(case.batch):
            one = {k: v[i] for k, v in inputs.items()}
            got = patched(**one, output_hidden_states=True)
            ref = patched(**{k: v[None] for k, v in one.items()}, output_hidden_states=True)
            _same_unbatched(f"example {i}", got, ref)
            if causal:
                got = patched(**one, loss_only=True)
                ref = patched(**{k: v[None] for k, v in one.items()}, loss_only=True)
                if got.logits is not None:
                    raise ConformanceError("unbatched loss_only=True returned logits")
                _same_unbatched(f"example {i}, loss_only=True", got, ref)
    grads, got_losses = _vmapped_grads(patched, inputs, loss_only=causal, unbatched=True)
    ref_grads, ref_losses = _vmapped_grads(patched, inputs, loss_only=causal)
    assert_grads_close(
        "unbatched vs [None] losses", {"loss": got_losses}, {"loss": ref_losses}, UNBATCHED_RTOL
    )
    assert_grads_close("unbatched vs [None] gradients", grads, ref_grads, UNBATCHED_RTOL)
    assert_grads_close(
        "unbatched per-example losses", {"loss": got_losses}, {"loss": torch.stack(losses)},
        case.rtol,
    )  # fmt: skip
    assert_grads_close("unbatched per-example gradients", grads, _stack(expected), case.rtol)


def _same_unbatched(what: str, got: Any, ref: Any) -> None:
    """``got`` (an unbatched call's output) is ``ref`` (the ``[None]`` call's) without its
    batch dimension: the loss a scalar, logits and every hidden state one dimension less."""
    pairs: dict[str, tuple[Any, Any]] = {"loss": (got.loss, ref.loss)}
    if ref.logits is not None:
        pairs["logits"] = (got.logits, ref.logits[0])
    for layer, (g, r) in enumerate(
        zip(got.hidden_states or (), ref.hidden_states or (), strict=True)
    ):
        pairs[f"hidden_states[{layer}]"] = (g, r[0])
    for name, (g, r) in pairs.items():
        if g is None or tuple(g.shape) != tuple(r.shape):
            shape = None if g is None else tuple(g.shape)
            raise ConformanceError(
                f"{what}: the unbatched call's {name} has shape {shape}; expected "
                f"{tuple(r.shape)} (the [None] call's without the batch dimension)"
            )
    assert_grads_close(
        f"{what}: unbatched vs [None] outputs",
        {name: g for name, (g, _) in pairs.items()},
        {name: r for name, (_, r) in pairs.items()},
        UNBATCHED_RTOL,
    )
