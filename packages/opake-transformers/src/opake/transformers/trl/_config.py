"""``DPSFTConfig`` and ``DPDPOConfig``: TRL's configs plus the DP fields of ``DPTrainingArguments``.

Each is :class:`~opake.transformers._args.DPArguments` (``target_epsilon`` or
``noise_multiplier``, ``target_delta``, ``per_sample_max_grad_norm``, ``clipping``,
``accountant``, ``dp_sampler``, ``engine``, ``microbatch_size``, ``memory_budget_gb``,
``reproducible``) combined with TRL's ``SFTConfig`` / ``DPOConfig``, checked the same way.
Three defaults differ from TRL's, and are those of ``DPTrainingArguments``: ``bf16=False``
(TRL turns bf16 on unless fp16 is set; bf16 works, ask for it), ``gradient_checkpointing=False``
(TRL turns it on; non-reentrant checkpointing works, ask for it) and ``max_grad_norm=0`` (the DP
clipping is ``per_sample_max_grad_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.trainer.dpo_config import DPOConfig
from trl.trainer.sft_config import SFTConfig

from opake.transformers._args import DPArguments

__all__ = ["DPDPOConfig", "DPSFTConfig"]

_BF16 = "bf16 autocast for the forward (clipping, sum and noise stay fp32); off by default."
_CHECKPOINTING = "Non-reentrant activation checkpointing (works with DP); off by default."


@dataclass
class DPSFTConfig(DPArguments, SFTConfig):
    """TRL's ``SFTConfig`` for :class:`~opake.transformers.trl.DPSFTTrainer` (DP-SGD).

    Every ``SFTConfig`` field, plus the DP fields of
    :class:`~opake.transformers.DPTrainingArguments` (see the module docstring for the three
    defaults that differ from TRL's). ``packing`` and ``padding_free`` are refused by the
    trainer: both put several records in one row, and a record is the privacy unit.

    Example:
        >>> from opake.transformers.trl import DPSFTConfig
        >>> config = DPSFTConfig(output_dir="out", target_epsilon=8.0, max_length=256,
        ...                      report_to="none")
        >>> config.target_epsilon, config.max_length, config.bf16, config.max_grad_norm
        (8.0, 256, False, 0.0)
    """

    bf16: bool = field(default=False, metadata={"help": _BF16})
    gradient_checkpointing: bool = field(default=False, metadata={"help": _CHECKPOINTING})


@dataclass
class DPDPOConfig(DPArguments, DPOConfig):
    """TRL's ``DPOConfig`` for :class:`~opake.transformers.trl.DPDPOTrainer` (DP-SGD).

    Every ``DPOConfig`` field, plus the DP fields of
    :class:`~opake.transformers.DPTrainingArguments` (see the module docstring for the three
    defaults that differ from TRL's). One preference record (prompt, chosen, rejected) is one
    example: ``per_device_train_batch_size`` counts records, each two rows of the forward.

    Example:
        >>> from opake.transformers.trl import DPDPOConfig
        >>> config = DPDPOConfig(output_dir="out", noise_multiplier=1.0, beta=0.1,
        ...                      report_to="none")
        >>> config.noise_multiplier, config.beta, config.loss_type
        (1.0, 0.1, ['sigmoid'])
    """

    bf16: bool = field(default=False, metadata={"help": _BF16})
    gradient_checkpointing: bool = field(default=False, metadata={"help": _CHECKPOINTING})
