"""Per-example losses of Hugging Face models: each example's loss from its own outputs only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["TASKS", "base_model", "detect_task", "has_dropout", "per_example_losses"]

TASKS = ("causal_lm", "sequence_classification")


def base_model(model: Any) -> Any:  # Any: a transformers model, read by attribute
    """The underlying transformers model of a PEFT (or plain) model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def has_dropout(model: Any) -> bool:
    """Whether ``model`` has an active random layer: an ``nn.Dropout`` module, or a float
    ``*dropout*`` attribute that attention layers read, or ``*jitter*`` (a MoE router's
    multiplicative noise, Mixtral's ``jitter_noise``) above 0: per-example gradients then need
    ``vmap(randomness="different")``, and the book-keeping engine's check cannot run."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name, value in vars(module).items():
            random = "dropout" in name or "jitter" in name
            if random and isinstance(value, float) and value > 0:
                return True
    return False


def detect_task(model: Any) -> str:
    """``"causal_lm"`` or ``"sequence_classification"`` from the model class (PEFT unwrapped)."""
    name = type(base_model(model)).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    raise ConfigurationError(
        f"DPTrainer: no per-example loss is built in for {name}; it covers *ForCausalLM and "
        "*ForSequenceClassification models. Pass per_example_loss=fn, where fn(outputs, batch) "
        "returns a [B] tensor with each example's loss computed from that example alone"
    )


def _causal(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    per_token = F.cross_entropy(
        shift_logits.transpose(1, 2),
        shift_labels,
        ignore_index=-100,
        reduction="none",
        label_smoothing=smoothing,
    )
    count = (shift_labels != -100).sum(dim=1)
    return per_token.sum(dim=1) / count.clamp(min=1).to(per_token.dtype)


def _classification(
    logits: torch.Tensor, labels: torch.Tensor, config: Any, smoothing: float
) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    logits = logits.float()
    num_labels = int(getattr(config, "num_labels", logits.shape[-1]))
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return (
            (logits.reshape(logits.shape[0], -1) - labels.float().reshape(labels.shape[0], -1))
            .pow(2)
            .mean(dim=1)
        )
    if problem == "single_label_classification":
        return F.cross_entropy(
            logits.view(-1, num_labels),
            labels.view(-1),
            reduction="none",
            label_smoothing=smoothing,
        )
    if problem == "multi_label_classification":
        bce = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
        return bce.reshape(bce.shape[0], -1).mean(dim=1)
    raise ConfigurationError(f"config.problem_type={problem!r}: not a sequence-classification type")


def per_example_losses(
    fmodel: Callable[..., Any],
    model: Any,
    *,
    task: str,
    label_smoothing: float = 0.0,
    custom: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None,
    autocast: Callable[[], Any] | None = None,
) -> Callable[..., torch.Tensor]:
    """The batched per-example loss ``fn(trainable, frozen, batch) -> [B]`` for ``BatchedLoss``.

    ``batch`` is the collated dict (``labels`` included); every entry keeps its batch
    dimension and entry ``i`` of the result depends on example ``i`` only. ``label_smoothing``
    is applied within each example (the Trainer's ``label_smoothing_factor``).
    """
    import contextlib

    config = getattr(base_model(model), "config", None)
    enter = autocast if autocast is not None else contextlib.nullcontext
    causal = task == "causal_lm"

    def losses(
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "labels"}
        if causal:
            inputs["use_cache"] = False
        with enter():
            outputs = fmodel((trainable, frozen), **inputs)
        if custom is not None:
            return custom(outputs, batch).float()
        labels = batch["labels"]
        if causal:
            return _causal(outputs.logits, labels, label_smoothing)
        return _classification(outputs.logits, labels, config, label_smoothing)

    return losses
