"""The conformance suite a model-family plugin runs against itself.

Every check builds two models from the plugin's factory — one patched through
:func:`opake.patches.apply_model_patches`, one never patched — and compares the patched model
under ``vmap`` with the trusted oracle: a per-example loop of plain autograd on the unpatched
model (:func:`opake.core.testing.per_example_grads_loop`). Inputs carry a 2-D padding mask
(right and left padding), as real batches do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._apply import unwrap_model

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKS",
    "ConformanceCase",
    "ConformanceError",
    "assert_grads_close",
    "run_check",
    "run_family_conformance",
]


class ConformanceError(AssertionError):
    """A model family failed a conformance check (the message says which and by how much)."""


@dataclass(frozen=True)
class ConformanceCase:
    """What the checks need to know about a family plugin's tiny model.

    Args:
        make_model: returns a fresh, tiny task model of the family, with the *same weights*
            on every call (seed inside), in eval mode. Eager attention is recommended:
            transformers' SDPA path has no ``vmap`` batching rule.
        kernels: kernel backend the patched model uses (``"chunked"`` by default; ``None``
            for automatic selection, ``"triton"`` under ``TRITON_INTERPRET=1``).
        batch, seq: shape of the test batch (example 0 unpadded, 1 right-padded, 2
            left-padded, further ones alternate).
        rtol: relative tolerance against the oracle (fp32).
        lora_targets: module names PEFT LoRA wraps in the ``lora`` check (default: the
            first two distinct linear layers inside the first decoder layer).
        layer_class: class name of the decoder layer (the checkpoint boundary) for the
            ``checkpointing`` check; default: the spec's, for a family built on
            :class:`~opake.models.FamilySpec`, else transformers' ``_no_split_modules`` when it
            names exactly one class.
        seed: seed of the test inputs.

    Example:
        >>> from opake.models.testing import ConformanceCase, tiny_model
        >>> case = ConformanceCase(lambda: tiny_model("llama"))
        >>> case.batch, case.kernels
        (3, 'chunked')
    """

    make_model: Callable[[], Any]
    kernels: str | None = "chunked"
    batch: int = 3
    seq: int = 8
    rtol: float = 1e-4
    lora_targets: tuple[str, ...] | None = None
    layer_class: str | None = None
    seed: int = 0
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.make_model):
            raise InputTypeError(
                f"ConformanceCase(make_model=...): expected a zero-argument callable returning "
                f"a model, got {type(self.make_model).__name__}."
            )
        for name in ("batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ConfigurationError(
                    f"ConformanceCase({name}={value!r}): expected an int >= 2."
                )
        if not isinstance(self.rtol, float) or not 0.0 < self.rtol < 1.0:
            raise ConfigurationError(f"ConformanceCase(rtol={self.rtol!r}): expected 0 < rtol < 1.")


# ----------------------------------------------------------------------------- helpers


def _task(model: Any) -> str:
    base = unwrap_model(model)
    name = type(base).__name__
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    output_embeddings = getattr(base, "get_output_embeddings", None)
    if callable(output_embeddings) and output_embeddings() is not None:
        return "causal_lm"
    raise ConformanceError(
        f"{name}: the conformance suite knows causal-LM models (with an output embedding) and "
        "*ForSequenceClassification models."
    )


def _fresh(case: ConformanceCase) -> Any:
    import torch

    model = case.make_model()
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(
            f"make_model() returned {type(model).__name__}; expected a torch.nn.Module."
        )
    return model


def _check_factory(case: ConformanceCase) -> None:
    import torch

    if case._cache.get("factory_ok"):
        return
    a, b = _fresh(case).state_dict(), _fresh(case).state_dict()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    if different:
        raise ConformanceError(
            f"make_model() returned different weights on two calls ({different[:3]} …): the "
            "checks compare a patched and an unpatched copy, so seed the factory."
        )
    case._cache["factory_ok"] = True


def _inputs(case: ConformanceCase, model: Any) -> dict[str, torch.Tensor]:
    """Input ids, a 2-D padding mask (right and left padding) and labels."""
    import torch

    config = model.config
    g = torch.Generator().manual_seed(case.seed)
    vocab = int(config.vocab_size)
    low = min(3, vocab - 1)
    ids = torch.randint(low, vocab, (case.batch, case.seq), generator=g)
    mask = torch.ones(case.batch, case.seq, dtype=torch.long)
    pad = max(1, case.seq // 3)
    for i in range(1, case.batch):
        if i % 2:
            mask[i, case.seq - pad :] = 0  # right padding
        else:
            mask[i, :pad] = 0  # left padding
    pad_id = getattr(config, "pad_token_id", None)
    if isinstance(pad_id, int) and 0 <= pad_id < vocab:
        ids = ids.masked_fill(mask == 0, pad_id)
    if _task(model) == "causal_lm":
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, int(config.num_labels), (case.batch,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _patch(model: Any, case: ConformanceCase, **options: Any) -> Any:
    from opake.patches import apply_model_patches

    return apply_model_patches(model, kernels=case.kernels, **options)


def _unpatch(model: Any) -> None:
    from opake.patches import remove_model_patches

    remove_model_patches(model)


def _loss_fn(fmodel: Any, task: str, *, loss_only: bool) -> Callable[..., torch.Tensor]:
    def loss_fn(
        params: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids[None],
            "attention_mask": attention_mask[None],
            "labels": labels[None],
        }
        if task == "causal_lm":
            kwargs["use_cache"] = False
            if loss_only:
                kwargs["loss_only"] = True
        return fmodel(params, **kwargs).loss

    return loss_fn


def _batch_args(inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inputs["input_ids"], inputs["attention_mask"], inputs["labels"]


def _reference(case: ConformanceCase, model: Any, inputs: Mapping[str, torch.Tensor]) -> Any:
    """Per-example gradients and losses of the unpatched model, one example at a time."""
    from opake.core.testing import per_example_grads_loop
    from opake.functional import make_functional

    fmodel, params = make_functional(model)
    loss_fn = _loss_fn(fmodel, _task(model), loss_only=False)
    return per_example_grads_loop(loss_fn, (params, *_batch_args(inputs)), batch_argnums=(1, 2, 3))


def _vmapped_grads(
    model: Any, inputs: Mapping[str, torch.Tensor], *, loss_only: bool, randomness: str = "error"
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    import torch
    from torch.func import grad_and_value, vmap

    from opake.functional import make_functional

    fmodel, params = make_functional(model)
    loss_fn = _loss_fn(fmodel, _task(model), loss_only=loss_only)
    with torch.no_grad():
        grads, losses = vmap(
            grad_and_value(loss_fn), in_dims=(None, 0, 0, 0), randomness=randomness
        )(params, *_batch_args(inputs))
    return grads, losses


def assert_grads_close(
    what: str,
    got: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    rtol: float = 1e-4,
) -> None:
    """Elementwise ``|got - expected| <= rtol * (|expected| + max|expected|)`` for every key;
    raises :class:`ConformanceError` naming the worst tensor.

    The second term makes the bound relative to the largest reference value, so entries that
    are nearly zero (a gradient that cancels) do not need an impossible relative accuracy.

    >>> import torch
    >>> assert_grads_close("w", {"w": torch.tensor([1.0, 2e-5])}, {"w": torch.tensor([1.0, 0.0])})
    >>> try:
    ...     assert_grads_close("w", {"w": torch.tensor([1.01])}, {"w": torch.tensor([1.0])})
    ... except AssertionError as err:
    ...     print(err)
    w: 'w' differs from the per-example loop by 50× the tolerance (rtol=0.0001, relative to the largest reference value 1)
    """  # noqa: E501 - the printed message is one line
    import torch

    missing = sorted(set(expected) ^ set(got))
    if missing:
        raise ConformanceError(f"{what}: parameter names differ: {missing[:5]}")
    scale = max(float(v.abs().max()) for v in expected.values()) or 1.0
    worst, where = 0.0, ""
    for name, ref in expected.items():
        diff = (got[name].to(torch.float64) - ref.to(torch.float64)).abs()
        bound = rtol * (ref.to(torch.float64).abs() + scale)
        excess = float((diff / bound).max())
        if not math.isfinite(excess) or excess > worst:
            worst, where = excess, name
    if not math.isfinite(worst) or worst > 1.0:
        raise ConformanceError(
            f"{what}: {where!r} differs from the per-example loop by {worst:.3g}× the "
            f"tolerance (rtol={rtol}, relative to the largest reference value {scale:.3g})"
        )


def _stack(per_example: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    import torch

    return {k: torch.stack([g[k] for g in per_example]) for k in per_example[0]}


def _zero_dropout(model: Any) -> None:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "attn_dropout_p"):
            if isinstance(module.__dict__.get(attr), float):
                setattr(module, attr, 0.0)


def _snapshot(model: Any) -> dict[str, Any]:
    """Instance attributes of every submodule, and the attributes of their classes."""
    classes = {type(m) for m in model.modules()} | set(type(model).__mro__)
    return {
        "instance": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "classes": {
            f"{cls.__module__}.{cls.__qualname__}": dict(vars(cls))
            for cls in classes
            if cls.__module__.startswith("transformers")
        },
    }


def _first_layer_linears(model: Any) -> tuple[str, ...]:
    """Names of the first two distinct linear layers (``Linear`` or GPT-2's ``Conv1D``) of
    the first decoder layer: what the ``lora`` check wraps by default."""
    import torch

    names: list[str] = []
    for full, module in model.named_modules():
        parts = full.split(".")
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if linear and "0" in parts and parts[-1] not in names:
            names.append(parts[-1])
    if not names:
        raise ConformanceError(
            "found no linear layer in the first decoder layer to wrap with LoRA; pass "
            "ConformanceCase(lora_targets=(...))."
        )
    return tuple(names[:2])


# ----------------------------------------------------------------------------- checks


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
        patched.gradient_checkpointing_enable()
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


#: name → check, in the order :func:`run_family_conformance` runs them
CHECKS: dict[str, Callable[[ConformanceCase], None]] = {
    "registered": check_registered,
    "outputs_match": check_outputs_match,
    "loss_only": check_loss_only,
    "per_example_grads": check_per_example_grads,
    "clipped_grads": check_clipped_grads,
    "checkpointing": check_checkpointing,
    "lora": check_lora,
    "dropout": check_dropout,
    "reversible": check_reversible,
    "instance_only": check_instance_only,
}


def run_check(name: str, case: ConformanceCase) -> None:
    """Run one check by name; raises :class:`ConformanceError` on failure.

    For pytest: ``@pytest.mark.parametrize("check", CHECKS)`` then ``run_check(check, case)``.
    """
    if name not in CHECKS:
        raise ConfigurationError(f"unknown conformance check {name!r}; known: {list(CHECKS)}.")
    CHECKS[name](case)


def run_family_conformance(
    make_model: Callable[[], Any],
    *,
    checks: Iterable[str] | None = None,
    **case_options: Any,
) -> dict[str, str]:
    """Run the conformance checks on a family's tiny model; raise if any fails.

    Args:
        make_model: zero-argument factory of a tiny task model (same weights on every call).
        checks: names from :data:`CHECKS` (default: all).
        **case_options: :class:`ConformanceCase` fields (``kernels``, ``batch``, ``seq``,
            ``rtol``, ``lora_targets``, ``seed``).

    Returns:
        check name → ``"ok"``. Every check runs; a :class:`ConformanceError` listing each
        failure is raised at the end.
    """
    case = ConformanceCase(make_model, **case_options)
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ConfigurationError(f"unknown conformance checks {unknown}; known: {list(CHECKS)}.")
    results: dict[str, str] = {}
    failures: list[str] = []
    for name in names:
        try:
            CHECKS[name](case)
        except Exception as err:  # collect every failure, then report them together
            results[name] = f"FAILED: {type(err).__name__}: {err}"
            failures.append(f"{name}: {type(err).__name__}: {err}")
        else:
            results[name] = "ok"
    if failures:
        raise ConformanceError("conformance failed:\n  " + "\n  ".join(failures))
    return results
