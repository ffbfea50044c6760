"""The SFT per-example loss (completion tokens only) and per-row sequence log-probabilities.

Both read the ``labels`` of a right-padded causal-LM batch: ``-100`` on every token that is not
a target (the prompt, a conversation's non-assistant turns, padding), the token id elsewhere;
the model predicts ``labels[:, t + 1]`` from position ``t``. Each row's value comes from its own
tokens only: no count, mean or decision is shared between rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.transformers._losses import base_model, per_example_losses

if TYPE_CHECKING:
    import torch

__all__ = ["completion_losses", "loss_only_available", "sequence_log_probs", "target_counts"]

_LOSS_ONLY_STAGE = "loss_only"


def loss_only_available(model: Any) -> bool:
    """Whether ``model`` (PEFT unwrapped) has Opake's loss-only head
    (``opake.patches.apply_model_patches``): ``model(..., labels=..., loss_only=True,
    per_example_loss=True)`` returns each row's mean loss without materialising the logits.

    >>> import torch
    >>> loss_only_available(torch.nn.Linear(2, 2))
    False
    """
    forward = getattr(base_model(model), "forward", None)
    seen = 0
    while forward is not None and seen < 32:  # the chain of patched forwards, outermost first
        if getattr(forward, "_opake_stage", None) == _LOSS_ONLY_STAGE:
            return True
        forward = getattr(forward, "__wrapped__", None)
        seen += 1
    return False


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """Each row's number of target tokens (labels other than -100 after the one-token shift).

    >>> import torch
    >>> target_counts(torch.tensor([[5, -100, 7, 8], [-100, -100, -100, 2]])).tolist()
    [2, 1]
    """
    return (labels[:, 1:] != -100).sum(dim=1)


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its target tokens ``[B]`` (fp32).

    ``logits [B, T, V]`` predict ``labels[:, 1:]``; positions labelled -100 count zero.

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)          # uniform over 4 tokens: log(1/4) per target
    >>> round(float(sequence_log_probs(logits, torch.tensor([[-100, 1, 2]]))[0]), 4)
    -2.7726
    """
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    per_token = F.cross_entropy(
        shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none"
    )
    return -per_token.sum(dim=1)


def completion_losses(
    fmodel: Callable[..., Any],
    model: Any,
    *,
    loss_only: bool = False,
    label_smoothing: float = 0.0,
    autocast: Callable[[], Any] | None = None,
) -> Callable[..., torch.Tensor]:
    """The SFT per-example loss ``fn(trainable, frozen, batch) -> [B]`` for ``BatchedLoss``.

    Entry ``i`` is the mean negative log-likelihood over example ``i``'s own target tokens
    (its completion, or a conversation's assistant turns: whatever ``labels`` does not mark
    -100), so a record's weight does not depend on how long the others are. An example without
    a target token gets 0. ``loss_only=True`` takes the loss from the patched model's loss-only
    head (no logits; :func:`loss_only_available`), the same value; it is not used with
    ``label_smoothing`` (which needs the logits).

    Example:
        >>> import torch
        >>> from opake.core.testing import tiny_llama
        >>> from opake.dpsgd.bookkeeping import BatchedLoss
        >>> from opake.dpsgd.clipping import clipped_grad
        >>> from opake.functional import make_functional
        >>> model = tiny_llama(hidden_size=16, num_hidden_layers=1, vocab_size=32,
        ...                    intermediate_size=32, seed=0)
        >>> fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        >>> loss = BatchedLoss(completion_losses(fmodel, model), fmodel)
        >>> batch = {"input_ids": torch.tensor([[3, 4, 5, 6], [7, 8, 9, 0]]),
        ...          "labels": torch.tensor([[-100, -100, 5, 6], [-100, 8, 9, -100]])}
        >>> grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=2)
        >>> grads, state = grad_fn(trainable, frozen, batch, state=state)
        >>> float(grads.max_norm)
        1.0
    """
    if not loss_only or label_smoothing:
        return per_example_losses(
            fmodel, model, task="causal_lm", label_smoothing=label_smoothing, autocast=autocast
        )
    import contextlib

    enter = autocast if autocast is not None else contextlib.nullcontext

    def losses(
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "labels"}
        with enter():
            out = fmodel(
                (trainable, frozen),
                **inputs,
                labels=batch["labels"],
                loss_only=True,
                per_example_loss=True,
                use_cache=False,
            )
        loss: torch.Tensor = out.loss.float()
        return loss

    return losses
