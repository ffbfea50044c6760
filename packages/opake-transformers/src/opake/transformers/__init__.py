"""DP-SGD fine-tuning with the Hugging Face ``Trainer``: ``DPTrainer`` and ``DPTrainingArguments``.

:class:`DPTrainer` is a ``transformers.Trainer`` whose step is Opake's DP-SGD step
(:class:`opake.dpsgd.training.DPTraining`): Poisson-sampled batches (expected size
``per_device_train_batch_size × gradient_accumulation_steps × world size``, one logical step
per optimizer step), collation that pads without mixing examples (:class:`DPDataCollator`),
per-example losses of causal-LM and sequence-classification models (PEFT included), clipping to
``per_sample_max_grad_norm``, Gaussian noise once per optimizer step, any optimizer and
scheduler the Trainer builds, ε/δ/σ/q in every log, the DP state in every checkpoint, a stop
when ``target_epsilon`` is spent, and DDP through ``torchrun``. See
``docs/guide/hf-trainer.md``.

Post-training: :mod:`opake.transformers.trl` (``DPSFTTrainer``, ``DPDPOTrainer``: TRL's trainers
with the same DP step; the ``trl`` extra) and :mod:`opake.transformers.losses` (the per-example
SFT and DPO losses, for ``clipped_grad`` / ``DPTraining``). See ``docs/guide/post-training.md``.

Names are imported on first use (``import opake.transformers`` does not import transformers).

>>> import opake.transformers as ot
>>> sorted(ot.__all__)  # doctest: +NORMALIZE_WHITESPACE
['DPDataCollator', 'DPTrainer', 'DPTrainingArguments', 'DP_STATE_FILE', 'check_positions',
 'length_dependent_rope']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opake.transformers._args import DPTrainingArguments
    from opake.transformers._collate import DPDataCollator
    from opake.transformers._positions import check_positions, length_dependent_rope
    from opake.transformers._trainer import DP_STATE_FILE, DPTrainer

_LAZY = {
    "DPTrainer": "_trainer",
    "DP_STATE_FILE": "_trainer",
    "DPTrainingArguments": "_args",
    "DPDataCollator": "_collate",
    "check_positions": "_positions",
    "length_dependent_rope": "_positions",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'opake.transformers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"opake.transformers.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DP_STATE_FILE",
    "DPDataCollator",
    "DPTrainer",
    "DPTrainingArguments",
    "check_positions",
    "length_dependent_rope",
]
