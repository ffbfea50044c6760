"""What ``DPTrainer`` refuses at construction: Trainer features that would break DP without
saying so (each with the reason and what to do instead).

The list is checked against the installed ``TrainingArguments``: a setting that this version of
transformers does not have (``group_by_length`` is gone from 5.25) is neither checked nor
listed by :func:`refused_settings`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["SECOND_RUN", "check_arguments", "check_model", "refused_settings"]


#: why a second ``train()`` on the same ``DPTrainer`` is refused (it raised RecursionError)
SECOND_RUN = (
    "DPTrainer.train() was already called on this trainer: a second run would train the same "
    "data again, and its ε adds to this run's. To continue this run, save a checkpoint and "
    "resume it with a new DPTrainer (train(resume_from_checkpoint=...): its accountant goes on "
    "from the saved history); to start another run knowingly, build a new DPTrainer (report "
    "both runs' ε together)"
)


_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("fp16", lambda a: bool(a.fp16), "fp16 needs a per-example loss scale; use bf16=True"),
    (
        "max_grad_norm",
        lambda a: bool(a.max_grad_norm),
        (
            "it would clip the noisy average, not each example; per_sample_max_grad_norm is "
            "the DP clipping (set max_grad_norm=0)"
        ),
    ),
    (
        "auto_find_batch_size",
        lambda a: bool(a.auto_find_batch_size),
        "changing the batch size mid-run changes the sampling rate the accounting assumes",
    ),
    (
        "dataloader_drop_last",
        lambda a: bool(a.dataloader_drop_last),
        "DP batches are Poisson samples; dropping examples would change the sampling",
    ),
    (
        "train_sampling_strategy",
        lambda a: getattr(a, "train_sampling_strategy", "random") != "random",
        "DPTrainer always draws Poisson batches (the only sampling ε is computed for)",
    ),
    (
        "group_by_length",
        lambda a: bool(getattr(a, "group_by_length", False)),
        "DPTrainer always draws Poisson batches (the only sampling ε is computed for)",
    ),
    ("deepspeed", lambda a: bool(a.deepspeed), "not supported with per-example clipping"),
    ("fsdp", lambda a: bool(a.fsdp), "not supported here; use DDP (torchrun)"),
    ("torch_compile", lambda a: bool(a.torch_compile), "not supported with per-example clipping"),
    (
        "neftune_noise_alpha",
        lambda a: a.neftune_noise_alpha is not None,
        "its embedding noise hook is not supported under per-example gradients",
    ),
    ("n_gpu", lambda a: a.n_gpu > 1, "DataParallel is not supported; launch one process per GPU"),
)


def _installed() -> tuple[tuple[str, Callable[[Any], bool], str], ...]:
    """The entries of :data:`_REFUSED` whose setting the installed ``TrainingArguments`` has."""
    from transformers import TrainingArguments

    return tuple(entry for entry in _REFUSED if hasattr(TrainingArguments, entry[0]))


def refused_settings() -> tuple[str, ...]:
    """The ``TrainingArguments`` settings ``DPTrainer`` refuses (those this transformers has).

    >>> "fp16" in refused_settings(), "max_grad_norm" in refused_settings()
    (True, True)
    """
    return tuple(name for name, _, _ in _installed())


def check_model(model: Any) -> None:
    """Trainable float16 weights: their per-example gradients would need a loss scale that the
    DP step does not apply (underflow to zero, overflow to inf), so they are refused."""
    import torch

    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype == torch.float16:
            raise ConfigurationError(
                f"DPTrainer: trainable parameter {name!r} is float16: per-example fp16 gradients "
                "need a loss scale that DPTrainer does not apply; keep trainable weights in "
                "float32 (or bfloat16) and set bf16=True for bf16 compute"
            )


def _checkpointing_kwargs(args: Any) -> None:
    """Non-reentrant activation checkpointing works (book-keeping); the reentrant path runs
    layers under ``no_grad`` and is refused. Unset ``use_reentrant`` is set to ``False``."""
    for flag, kwargs_name in (
        ("activation_checkpointing", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing", "gradient_checkpointing_kwargs"),
    ):
        if not getattr(args, flag, None):
            continue
        options = dict(getattr(args, kwargs_name, None) or {})
        if options.get("use_reentrant", False):
            raise ConfigurationError(
                f"{kwargs_name}={{'use_reentrant': True}}: the reentrant checkpointing path "
                "recomputes layers under no_grad, which per-example clipping cannot see "
                "through; drop use_reentrant (DPTrainer sets it to False)"
            )
        options["use_reentrant"] = False
        setattr(args, kwargs_name, options)


def check_arguments(args: Any) -> None:
    """Refuse the arguments in :data:`_REFUSED`; make activation checkpointing non-reentrant."""
    for name, refused, why in _installed():
        if refused(args):
            raise ConfigurationError(f"DPTrainer: {name}={getattr(args, name)!r}: {why}")
    _checkpointing_kwargs(args)
