"""``DPSFTTrainer``: TRL's ``SFTTrainer`` with the DP-SGD step of ``DPTrainer``.

TRL prepares the data as it always does — chat ``messages`` through the tokenizer's chat
template, ``prompt``/``completion`` records, ``text`` — and builds ``labels`` with -100 on every
token that is not a target (the prompt; with ``assistant_only_loss=True`` every non-assistant
token). The DP step replaces TRL's loss and backward: each record is one example, its loss the
mean negative log-likelihood over its own target tokens
(:func:`opake.transformers.losses.completion_losses`), clipped on its own; batches are
Opake's Poisson batches. What would mix records is refused (``packing``, ``padding_free``, …;
:mod:`opake.transformers.trl._refusals`), and the records ``max_length`` truncates are counted
(:mod:`opake.transformers.trl._truncation`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.sft_trainer import SFTTrainer

from opake.core.errors import ConfigurationError, InputTypeError
from opake.transformers._dp_mixin import DPTrainerMixin
from opake.transformers.losses import completion_losses, loss_only_available
from opake.transformers.trl._config import DPSFTConfig
from opake.transformers.trl._refusals import check_built, check_sft_config
from opake.transformers.trl._truncation import Truncation, count_sft, report, with_counts

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

__all__ = ["DPSFTTrainer"]

logger = logging.getLogger("opake.transformers")


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` that trains with DP-SGD (one record = one example).

    Takes every ``SFTTrainer`` argument (``model``, ``args``, ``train_dataset``,
    ``processing_class``, ``peft_config``, ``formatting_func``, …) as keywords, with ``args`` a
    :class:`~opake.transformers.trl.DPSFTConfig`, and TRL's dataset formats. The guarantees are
    ``DPTrainer``'s: Poisson sampling, ε/δ/σ/q in every log, the stop when ``target_epsilon`` is
    spent, the DP state in every checkpoint and exact resume, and the refusals of
    :class:`~opake.transformers.DPTrainer` plus ``packing``, ``padding_free``,
    ``activation_offloading``, ``use_liger_kernel``, a ``loss_type`` other than ``"nll"``, a
    vision dataset and a Mixture-of-Experts load-balancing loss.

    The per-example loss is the mean negative log-likelihood over the record's own target
    tokens (prompt tokens, and with ``assistant_only_loss`` every non-assistant token, get no
    gradient); a model patched with ``opake.patches.apply_model_patches`` computes it with its
    loss-only head (no logits). Evaluation is TRL's own (not private). TRL's telemetry is off.

    Attributes:
        truncation: what ``max_length`` did to each dataset TRL prepared
            (``{"train": Truncation(records, truncated, dropped, max_length), ...}``; not
            private), also logged.
        uses_loss_only: whether the loss comes from the patched model's loss-only head.
    """

    _wraps_trainer_collator = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "per_example_loss" in kwargs:
            raise ConfigurationError(
                "DPSFTTrainer's per-example loss is the completion loss; for another loss use "
                "opake.transformers.DPTrainer(per_example_loss=...)"
            )
        config = kwargs.get("args")
        if isinstance(config, DPSFTConfig):
            check_sft_config(config)
        model = kwargs.get("model")
        self.truncation: dict[str, Truncation] = {}
        self.uses_loss_only = (
            model is not None and not isinstance(model, str) and loss_only_available(model)
        )
        super().__init__(*args, **kwargs)
        check_built(self)
        columns = getattr(kwargs.get("train_dataset"), "column_names", None) or ()
        if "messages" in columns and not self.args.assistant_only_loss:
            logger.warning(
                "DPSFTTrainer: conversations are trained on every token, the user's turns "
                "included (TRL's default); set assistant_only_loss=True to train on the "
                "assistant's turns only"
            )
        if self.uses_loss_only:
            logger.info("DPSFTTrainer: per-example losses from the model's loss-only head")

    def _check_arguments_type(self, training_args: object) -> None:
        if not isinstance(training_args, DPSFTConfig):
            raise InputTypeError(
                f"DPSFTTrainer(args={type(training_args).__name__}): expected DPSFTConfig "
                "(TRL's SFTConfig plus target_epsilon / noise_multiplier, target_delta, "
                "per_sample_max_grad_norm, ...)"
            )

    def _send_telemetry(self) -> None:
        """Opake's DP trainers send nothing anywhere."""

    def _prepare_dataset(  # noqa: PLR0917 - SFTTrainer's signature
        self,
        dataset: Any,
        processing_class: Any,
        args: Any,
        packing: bool,
        formatting_func: Callable[[dict[str, Any]], str] | None,
        dataset_name: str,
    ) -> Dataset | IterableDataset:
        """TRL's preparation, in two passes to count truncation: tokenise and label without
        ``max_length``, count, then let TRL truncate (its preparation skips the done steps)."""
        import datasets

        max_length = args.max_length
        if max_length is None or packing or not isinstance(dataset, datasets.Dataset):
            return super()._prepare_dataset(
                dataset, processing_class, args, packing, formatting_func, dataset_name
            )
        whole = copy.copy(args)
        whole.max_length = None
        untruncated = super()._prepare_dataset(
            dataset, processing_class, whole, packing, formatting_func, dataset_name
        )
        counts = count_sft(untruncated, max_length, args.truncation_mode == "keep_start")
        self.truncation[dataset_name] = counts
        report("DPSFTTrainer", dataset_name, counts)
        return super()._prepare_dataset(
            untruncated, processing_class, args, packing, None, dataset_name
        )

    def _batched_losses(self, fmodel: Any, model: Any) -> Callable[..., torch.Tensor]:
        return completion_losses(
            fmodel,
            model,
            loss_only=self.uses_loss_only,
            label_smoothing=float(self.args.label_smoothing_factor or 0.0),
            autocast=self._autocast(),
        )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ε, δ, σ, q to every log; the truncation counts to the training summary."""
        super().log(with_counts(logs, self.truncation.get("train")), *args, **kwargs)
