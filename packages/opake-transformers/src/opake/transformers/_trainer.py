"""``DPTrainer``: the Hugging Face ``Trainer`` with the DP-SGD step of ``opake.dpsgd.training``.

How the Trainer's loop maps onto DP-SGD is :mod:`opake.transformers._dp_mixin`'s (the mixin is
shared with the TRL trainers of :mod:`opake.transformers.trl`); what is ``DPTrainer``'s own is
its evaluation collator and the pass-through of a ``data_collator`` to DP-safe padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import Trainer

from opake.transformers._dp_mixin import DP_STATE_FILE, DPTrainerMixin
from opake.transformers._train_loader import EXAMPLE_MASK_KEY

__all__ = ["DP_STATE_FILE", "EXAMPLE_MASK_KEY", "DPTrainer"]


class DPTrainer(DPTrainerMixin, Trainer):
    """``transformers.Trainer`` that trains with DP-SGD (see :mod:`opake.transformers`).

    Takes every ``Trainer`` argument, with ``args`` a
    :class:`~opake.transformers.DPTrainingArguments`, plus:

    Args:
        per_example_loss: ``fn(outputs, batch) -> [B]`` for models other than causal LMs and
            sequence classifiers (each entry from its own example only). Default: built in.
        **kwargs: the ``Trainer`` arguments (``model``, ``args``, ``train_dataset``, ...).

    Trainer features that would break DP without saying so are refused at construction
    (``ConfigurationError``): fp16 (and trainable float16 weights; ``bf16=True`` works: bf16
    autocast for the forward, clipping, sum and noise in fp32), ``max_grad_norm``,
    ``auto_find_batch_size``, ``dataloader_drop_last``, non-random
    ``train_sampling_strategy`` (and ``group_by_length`` where transformers has it),
    DeepSpeed, FSDP, NEFTune, DataParallel, reentrant activation checkpointing,
    ``compute_loss_func`` and an iterable training set. When training begins,
    a training loader other than the one :meth:`get_train_dataloader` builds (e.g. a subclass
    returning a shuffled ``DataLoader``) is refused, and so is any physical batch that is not
    the Poisson sampler's draw. ``label_smoothing_factor`` is applied within each example; the
    Trainer's token-count normalisation across the batch (``num_items_in_batch``) is never used.

    Without ``microbatch_size``, the per-device microbatch is chosen when training starts: the
    whole physical batch at once when its estimated peak fits the memory (``memory_budget_gb``,
    else half of what is available), else the largest power of two that does (measured with
    ``opake.profiling``'s tuner on random tokens; privacy-neutral). The choice and why are
    logged on the ``opake.transformers`` logger and kept in ``microbatch_choice``.

    ``torch_compile=True`` compiles the DP step once, through ``DPTraining(compile=True)``
    (the vmap engine, one graph), and not the model (evaluation runs eager): each physical
    batch runs as chunks of one size (``microbatch_size``, else the automatic microbatch, else
    the physical batch; the last chunk padded with masked rows) and every training batch is
    padded to the longest training example, so one shape is compiled. Refused with it:
    ``engine="bookkeeping"``, ``privacy_unit_column`` and a ``torch_compile_backend`` or
    ``torch_compile_mode`` other than torch.compile's defaults.

    Attributes:
        privacy_stop_message: why training stopped early (the budget), or ``None``.
        microbatch_choice: the automatic microbatch and its reason (``None`` until training
            starts, and when ``microbatch_size`` was given).
    """

    def __init__(
        self,
        *args: Any,
        per_example_loss: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, per_example_loss=per_example_loss, **kwargs)
        if self._task == "causal_lm":
            # evaluation builds labels from input_ids as training does (the stock eval collator
            # would give a causal LM no labels, hence no eval_loss); a plain forward there, so
            # the 2-D attention mask is kept
            self.data_collator = self._dp_collator(engine_mask=False)
        elif self._user_collator is not None:
            self.data_collator = self._user_collator
