"""The conformance suite's shared parts: the case, its inputs, the oracle, the comparison."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._apply import unwrap_model

if TYPE_CHECKING:
    import torch

    from opake.patches import ModelPatchReport

__all__ = [
    "ConformanceCase",
    "ConformanceError",
    "assert_grads_close",
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


def _fresh(case: ConformanceCase) -> torch.nn.Module:
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


def _patch(model: torch.nn.Module, case: ConformanceCase, **options: Any) -> ModelPatchReport:
    from opake.patches import apply_model_patches

    return apply_model_patches(model, kernels=case.kernels, **options)


def _unpatch(model: Any) -> None:
    from opake.patches import remove_model_patches

    remove_model_patches(model)


def _loss_fn(
    fmodel: Any, task: str, *, loss_only: bool, unbatched: bool = False
) -> Callable[..., torch.Tensor]:
    """One example's loss; the model gets a batch of one (``x[None]``), or with ``unbatched``
    the example as it is (the patched model adds the batch dimension itself)."""

    def loss_fn(
        params: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }
        if not unbatched:
            kwargs = {k: v[None] for k, v in kwargs.items()}
        if task == "causal_lm":
            kwargs["use_cache"] = False
            if loss_only:
                kwargs["loss_only"] = True
        loss: torch.Tensor = fmodel(params, **kwargs).loss
        return loss

    return loss_fn


def _batch_args(inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inputs["input_ids"], inputs["attention_mask"], inputs["labels"]


def _reference(
    case: ConformanceCase, model: Any, inputs: Mapping[str, torch.Tensor]
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Per-example gradients and losses of the unpatched model, one example at a time."""
    from opake.core.testing import per_example_grads_loop
    from opake.functional import make_functional

    fmodel, params = make_functional(model)
    loss_fn = _loss_fn(fmodel, _task(model), loss_only=False)
    return per_example_grads_loop(loss_fn, (params, *_batch_args(inputs)), batch_argnums=(1, 2, 3))


def _vmapped_grads(
    model: Any,
    inputs: Mapping[str, torch.Tensor],
    *,
    loss_only: bool,
    randomness: str = "error",
    unbatched: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    import torch
    from torch.func import grad_and_value, vmap

    from opake.functional import make_functional

    fmodel, params = make_functional(model)
    loss_fn = _loss_fn(fmodel, _task(model), loss_only=loss_only, unbatched=unbatched)
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
