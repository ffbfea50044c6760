"""What ``DPTrainer`` refuses at construction: Trainer features that would break DP without
saying so (each with the reason and what to do instead).

The list is checked against the installed ``TrainingArguments``: a setting that this version of
transformers does not have (``group_by_length`` is gone from 5.25) is neither checked nor
listed by :func:`refused_settings`. ``torch_compile`` is supported (the DP step compiles through
``DPTraining(compile=True)``); what does not compile with it is refused by :func:`check_compile`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["SECOND_RUN", "check_arguments", "check_compile", "check_model", "refused_settings"]


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
    (
        "include_num_input_tokens_seen",
        lambda a: getattr(a, "include_num_input_tokens_seen", "no") not in ("no", False),
        (
            "every log would carry the exact token count of the Poisson batches trained so far, "
            "whose differences give each step's batch size, un-noised (ε assumes the draw "
            "stays secret); leave it 'no'"
        ),
    ),
    (
        "load_best_model_at_end",
        lambda a: bool(a.load_best_model_at_end),
        (
            "it picks the released weights by the un-noised evaluation metric, so the model "
            "would depend on the evaluation records through no noise; evaluate on public data "
            "and pick the checkpoint yourself after training (every saved checkpoint is DP, and "
            "choosing among them with public data is post-processing)"
        ),
    ),
    ("deepspeed", lambda a: bool(a.deepspeed), "not supported with per-example clipping"),
    (
        "fsdp",
        lambda a: bool(a.fsdp),
        (
            "the Trainer's FSDP wrapping swaps gathered parameters in under the per-example "
            "gradients and reduces gradients itself; DP-SGD with FSDP2 (per-layer sharded "
            "compute) runs "
            "through opake.dpsgd.training.DPTraining(..., shard=True) on a fully_shard-ed model "
            "or `opake train --shard` under torchrun; DPTrainer runs DDP (launch with torchrun, "
            "without fsdp)"
        ),
    ),
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
    DP step does not apply (underflow to zero, overflow to inf), so they are refused; so is a
    rotary embedding that depends on the batch's sequence length (:mod:`._positions`)."""
    import torch

    from opake.transformers._positions import check_positions

    check_positions(model, "DPTrainer")
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


#: torch.compile's defaults, the only ones the compiled DP step takes (backend, mode)
_COMPILE_DEFAULTS = {
    "torch_compile_backend": (None, "inductor"),
    "torch_compile_mode": (None, "default"),
}


def check_compile(args: Any) -> None:
    """With ``torch_compile``: refuse what the compiled DP step cannot do (privacy units, a
    backend or mode other than torch.compile's defaults)."""
    if not getattr(args, "torch_compile", False):
        return
    column = getattr(args, "privacy_unit_column", None)
    if column is not None:
        raise ConfigurationError(
            f"DPTrainer: torch_compile=True with privacy_unit_column={column!r}: the plan that "
            "keeps each unit's records in one chunk is computed on the host and does not "
            "trace; train user-level DP with torch_compile=False"
        )
    for name, defaults in _COMPILE_DEFAULTS.items():
        value = getattr(args, name, None)
        if value not in defaults:
            raise ConfigurationError(
                f"DPTrainer: {name}={value!r}: the DP step is compiled with torch.compile's "
                f"default backend (inductor) and mode only; drop {name} or set "
                "torch_compile=False (on HPU and Neuron devices transformers picks its own "
                "backend, so compiling the DP step there is not supported)"
            )


def check_arguments(args: Any) -> None:
    """Refuse the arguments in :data:`_REFUSED` and what :func:`check_compile` refuses; make
    activation checkpointing non-reentrant."""
    for name, refused, why in _installed():
        if refused(args):
            raise ConfigurationError(f"DPTrainer: {name}={getattr(args, name)!r}: {why}")
    check_compile(args)
    _checkpointing_kwargs(args)
