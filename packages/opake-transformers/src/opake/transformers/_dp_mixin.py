"""The DP-SGD behaviour of every Opake trainer, as a mixin over a ``transformers.Trainer`` class.

``DPTrainer`` is ``DPTrainerMixin`` over ``transformers.Trainer``; ``DPSFTTrainer`` and
``DPDPOTrainer`` (:mod:`opake.transformers.trl`) are the same mixin over TRL's trainers. It owns
everything privacy-critical, once: the training ``DataLoader`` draws Poisson batches, one logical
batch per optimizer step split into ``gradient_accumulation_steps`` physical batches per rank,
and the Trainer may iterate no other loader nor any batch the DP sampler did not draw
(:mod:`opake.transformers._train_loader`); :meth:`training_step` clips and sums each physical
batch (:meth:`DPTraining.accumulate`) instead of ``loss.backward()``; the Trainer's
``optimizer.step()`` is :meth:`DPTraining.finish_step` (noise once, division by the expected
batch size, the Trainer-built optimizer, one accountant step); ε, δ, σ and q join every ``log``;
the DP state joins every checkpoint and is restored on resume.

A subclass changes only what its objective needs, through four hooks: the batched per-example
loss (:meth:`_batched_losses`), the DP-safe collator (:meth:`_dp_collator`), how one physical
batch is clipped and summed (:meth:`_accumulate`: DPO weighs each pair and makes it one privacy
unit) and what the memory probe measures (:meth:`_probe`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from opake.core.choices import TRAINING_PLD_OPTIONS
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.transformers._args import DPArguments
from opake.transformers._checkpoint import DP_STATE_FILE, load_dp_state, save_dp_state
from opake.transformers._collate import DPDataCollator, PoissonBatches
from opake.transformers._compile import (
    accelerator_args_without_compile,
    check_model_not_compiled,
    chunk_rows,
    dp_engine,
    sequence_length,
)
from opake.transformers._hf_checks import make_checks_transform_safe
from opake.transformers._losses import base_model, detect_task, has_dropout, per_example_losses
from opake.transformers._microbatch import MicrobatchChoice, longest_example, trainer_microbatch
from opake.transformers._refusals import SECOND_RUN, check_arguments, check_model
from opake.transformers._released import ReleaseGuard
from opake.transformers._rows import check_classifier_padding
from opake.transformers._sampling import (
    trainer_fixed_slots,
    trainer_population,
    trainer_unit_keys,
    trainer_unit_rows,
    without_column,
)
from opake.transformers._step import DPStep, PrivacyBudget, log_setup
from opake.transformers._train_loader import (
    BATCH_INDICES_KEY,
    EXAMPLE_MASK_KEY,
    DrawnBatches,
    check_train_loader,
    poisson_loader,
)

if TYPE_CHECKING:
    from opake.dpsgd.training import DPTraining

__all__ = ["DP_STATE_FILE", "DPTrainerMixin"]

#: PLD discretisation: pessimistic (ε stays an upper bound) and fast enough for every step
_PLD_OPTIONS = dict(TRAINING_PLD_OPTIONS)


class DPTrainerMixin(ReleaseGuard):
    """DP-SGD training for a ``transformers.Trainer`` class (see the module docstring).

    Put it first in the bases: ``class DPTrainer(DPTrainerMixin, Trainer)``.
    """

    args: Any  # DPArguments combined with TrainingArguments (or a TRL config); checked in __init__
    #: keep the collator the base trainer built (TRL's) and make it DP-safe; DPTrainer instead
    #: takes ``data_collator`` out of the Trainer's hands and pads itself
    _wraps_trainer_collator = False

    def __init__(
        self,
        *args: Any,
        per_example_loss: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if args:
            raise ConfigurationError(
                f"{name} takes keyword arguments only (model=..., args=..., train_dataset=...)"
            )
        self._check_arguments_type(kwargs.get("args"))
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigurationError(
                "compute_loss_func computes one loss for a whole batch; DP needs each "
                "example's loss: pass per_example_loss=fn(outputs, batch) -> [B] instead"
            )
        if per_example_loss is not None and not callable(per_example_loss):
            raise InputTypeError(f"per_example_loss={per_example_loss!r}: expected a callable")
        check_arguments(kwargs["args"])
        if not self._wraps_trainer_collator:
            self._user_collator = kwargs.pop("data_collator", None)
        super().__init__(**kwargs)
        if self._wraps_trainer_collator:
            self._user_collator = self.data_collator
        dataset = self.train_dataset
        if dataset is not None and (
            isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__")
        ):
            raise ConfigurationError(
                f"{name} needs a map-style train_dataset with a length: Poisson sampling "
                "draws each example independently, which an iterable dataset cannot do"
            )
        check_model(self.model)
        check_model_not_compiled(self)
        make_checks_transform_safe(self.model)
        self._per_example_loss = per_example_loss
        self._task = "custom" if per_example_loss is not None else detect_task(self.model)
        if self._task == "sequence_classification":  # pooled by the pad id: the collator's
            check_classifier_padding(base_model(self.model), self._collator_pad())
        self._dp: DPTraining | None = None
        self._units: list[Any] | None = None
        # the training loader get_train_dataloader built last and its batch sampler (the only
        # ones the Trainer may iterate), and the check of each physical batch against the draw
        self._train_loader: Any = None
        self._train_batches: PoissonBatches | None = None
        self._drawn = DrawnBatches(self.args.gradient_accumulation_steps, self.args.dp_sampler)
        #: the functional view of the parameters the DP step differentiates (trainable, frozen)
        self._dp_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self.privacy_stop_message: str | None = None
        self.microbatch_choice: MicrobatchChoice | None = None
        self.add_callback(PrivacyBudget(self))

    def _check_arguments_type(self, training_args: object) -> None:
        """Refuse ``args`` without the DP fields (``InputTypeError``)."""
        from transformers import TrainingArguments

        if not (
            isinstance(training_args, DPArguments) and isinstance(training_args, TrainingArguments)
        ):
            raise InputTypeError(
                f"{type(self).__name__}(args={type(training_args).__name__}): expected "
                "DPTrainingArguments (TrainingArguments plus target_epsilon / noise_multiplier, "
                "target_delta, per_sample_max_grad_norm, ...)"
            )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's accelerator arguments; with ``torch_compile`` it compiles no model
        (the DP step compiles itself, once: :mod:`opake.transformers._compile`)."""
        built: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        return accelerator_args_without_compile(built) if self.args.torch_compile else built

    # -- the privacy parameters ---------------------------------------------------------------

    @property
    def dp_training(self) -> DPTraining:
        """The DP step composition (built when training starts)."""
        if self._dp is None:
            raise OperationError(
                "the DP step is built when training starts (create_optimizer); call train()"
            )
        return self._dp

    def _dataset_size(self) -> int:
        if self.train_dataset is None:
            raise ConfigurationError(f"{type(self).__name__}: training requires a train_dataset")
        dataset: Any = self.train_dataset
        size: int = len(dataset)
        return size

    def _expected_batch_size(self) -> int:
        a = self.args
        return int(a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size)

    def _steps_per_epoch(self) -> int:
        n = trainer_population(self)
        expected = self._expected_batch_size()
        if expected > n:
            what = "examples" if trainer_unit_keys(self) is None else "privacy units"
            raise ConfigurationError(
                f"expected logical batch {expected} (per_device_train_batch_size × "
                f"gradient_accumulation_steps × world size) exceeds the {n} training {what}"
            )
        return max(1, round(n / expected))

    def _planned_steps(self) -> int:
        a = self.args
        if a.max_steps and a.max_steps > 0:
            return int(a.max_steps)
        steps: int = max(1, math.ceil(a.num_train_epochs * self._steps_per_epoch()))
        return steps

    # -- data ---------------------------------------------------------------------------------

    def get_train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        """Poisson batches in physical chunks, collated without mixing examples.

        The loader returned is the only one the Trainer may iterate: do not override this
        method to return another (a shuffled ``DataLoader`` would be trained on as if it were
        Poisson-sampled); training refuses it.
        """
        dataset: Any = self.train_dataset
        if dataset is None:
            raise ConfigurationError(f"{type(self).__name__}: training requires a train_dataset")
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
        except ImportError:
            pass
        collator = self._dp_collator(pad_to=sequence_length(self.args, dataset))
        column = getattr(self.args, "privacy_unit_column", None)
        if column is not None:  # the units come from the sampler; the model never sees them
            collator = without_column(collator, column)
        batches = PoissonBatches(
            lambda: self.dp_training.sampler,
            chunks=self.args.gradient_accumulation_steps,
            steps_per_epoch=self._steps_per_epoch(),
        )
        loader = poisson_loader(
            dataset,
            collator,
            batches,
            fixed=self.args.dp_sampler == "fixed",
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        self._train_loader, self._train_batches = loader, batches
        return loader

    def _dp_collator(
        self, *, engine_mask: bool = True, pad_to: int | None = None
    ) -> Callable[[list[Any]], dict[str, Any]]:
        """The user's collator (if any) made DP-safe: padding never mixes examples, causal-LM
        labels from ``input_ids`` with padding ignored (``engine_mask``, ``pad_to``: see
        DPDataCollator)."""
        return DPDataCollator(
            pad_token_id=self._collator_pad(),
            causal=self._task == "causal_lm",
            base=self._user_collator,
            engine_mask=engine_mask,
            pad_to=pad_to,
        )

    def _collator_pad(self) -> int:
        """The id the collator pads ``input_ids`` with: the processing class's, else 0."""
        pad = getattr(self.processing_class, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _check_train_loader(self, loader: object) -> None:
        """Refuse (``ConfigurationError``) a training loader that is not the one
        :meth:`get_train_dataloader` built; start the per-batch check afresh."""
        check_train_loader(
            loader, self._train_loader, self._train_batches, mode=self.args.dp_sampler
        )
        self._drawn = DrawnBatches(self.args.gradient_accumulation_steps, self.args.dp_sampler)

    # -- the DP step --------------------------------------------------------------------------

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Build the Trainer's optimizer, then the DP step around it."""
        if isinstance(self.optimizer, DPStep):
            return self.optimizer
        if self._dp is not None:  # a second train() of this trainer
            raise OperationError(SECOND_RUN.replace("DPTrainer", type(self).__name__))
        inner = super().create_optimizer(model) if model is not None else super().create_optimizer()
        self._dp = self._build_training(inner)
        self.optimizer = DPStep(inner, self)
        return self.optimizer

    def _autocast(self) -> Callable[[], Any] | None:
        if not self.args.bf16:
            return None
        device = self.args.device.type
        return lambda: torch.autocast(device, dtype=torch.bfloat16)

    def _batched_losses(self, fmodel: Any, model: Any) -> Callable[..., torch.Tensor]:
        """The batched per-example loss ``fn(trainable, frozen, batch) -> [B]``."""
        task = "causal_lm" if self._task == "custom" else self._task
        return per_example_losses(
            fmodel,
            model,
            task=task,
            label_smoothing=float(self.args.label_smoothing_factor or 0.0),
            custom=self._per_example_loss,
            autocast=self._autocast(),
        )

    def _build_training(self, inner: torch.optim.Optimizer) -> DPTraining:
        from opake.dpsgd.bookkeeping import BatchedLoss
        from opake.dpsgd.clipping import AutoSClipping
        from opake.dpsgd.training import DPTraining
        from opake.functional import make_functional

        a = self.args
        model: Any = self.model
        n = self._dataset_size()
        fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        self._dp_params = (trainable, frozen)
        clip: Any = a.per_sample_max_grad_norm
        if a.clipping == "automatic":
            clip = AutoSClipping(clipping_norm=a.per_sample_max_grad_norm)
        loss = BatchedLoss(self._batched_losses(fmodel, model), fmodel)
        # dropout draws per-example masks under vmap; without it book-keeping can be exact
        randomness = "different" if has_dropout(model) else "error"
        delta = (
            a.target_delta if a.target_delta is not None else 1.0 / trainer_population(self) ** 2
        )
        max_batch = trainer_fixed_slots(self, n, delta) if a.dp_sampler == "fixed" else None
        engine, microbatch = dp_engine(a), a.microbatch_size
        if microbatch is None:
            self.microbatch_choice = self._default_microbatch(
                loss, fmodel, (trainable, frozen), randomness, max_batch, engine=engine
            )
            microbatch = self.microbatch_choice.microbatch
        microbatch = chunk_rows(a, microbatch, max_batch=max_batch)  # torch_compile: one shape
        training = DPTraining(
            loss,
            inner,
            trainable,
            args=(frozen,),
            module=model,
            dataset_size=n,
            expected_batch_size=float(self._expected_batch_size()),
            noise_multiplier=a.noise_multiplier,
            target_epsilon=a.target_epsilon,
            steps=self._planned_steps(),
            delta=delta,
            clipping_norm=clip,
            engine=engine,
            microbatch_size=microbatch,
            randomness=randomness,
            accountant=a.accountant,
            accountant_options=dict(_PLD_OPTIONS) if a.accountant == "pld" else None,
            sampler=a.dp_sampler,
            max_batch_size=max_batch,
            steps_per_epoch=self._steps_per_epoch(),
            seed=a.seed if a.reproducible else None,
            privacy_units=trainer_unit_keys(self),
            max_records_per_unit=getattr(a, "max_records_per_unit", None),
            compile=bool(a.torch_compile),
        )
        log_setup(training, a)
        return training

    def _probe(self, loss: Any, fmodel: Any, model: Any) -> tuple[Any, int, int | None]:
        """What the memory probe measures: ``(loss, rows per example, longest row)`` — the
        loss the probe differentiates on random tokens, how many rows of the batched forward
        one training example is, and the most tokens of a row (``None``: unknown)."""
        return loss, 1, longest_example(self.train_dataset)

    def _default_microbatch(
        self,
        loss: Any,
        fmodel: Any,
        params: tuple[Any, ...],
        randomness: str,
        max_batch: int | None,
        *,
        engine: str,
    ) -> MicrobatchChoice:
        """The per-device microbatch when ``microbatch_size`` is not set (memory-aware, from
        the profiling tuner's measurements; privacy-neutral)."""
        probe_loss, rows, length = self._probe(loss, fmodel, self.model)
        sizes = trainer_unit_rows(self)
        return trainer_microbatch(
            self,
            probe_loss,
            params,
            rows=rows,
            length=length,
            randomness=randomness,
            max_batch=max_batch,
            sizes=sizes,
            engine=engine,
        )

    def _bind_params(self) -> None:
        """Re-take the functional view of the parameters once the Trainer prepared the model:
        a wrapper (DDP under ``torchrun``) may have given the parameters new storage, which
        the tensors taken when the optimizer was built would no longer see."""
        from opake.functional import make_functional

        if self._dp is None:
            return
        model: Any = self.model
        _, trainable, frozen = make_functional(model, partition_trainable=True)
        self._dp.set_params(trainable, args=(frozen,))
        self._dp_params = (trainable, frozen)

    def training_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """Clip and sum one physical batch (no backward, no noise yet).

        Returns this physical batch's loss sum divided by the expected per-rank batch, so the
        Trainer's logged ``loss`` estimates the mean example loss (a diagnostic: not private).
        """
        dp = self.dp_training
        inputs = dict(inputs)
        indices = inputs.pop(BATCH_INDICES_KEY, None)
        # refuse a batch the Poisson sampler did not draw, before any of it is used
        self._drawn.check(indices, dp.sampler, dp.steps, dp.pending_batches > 0)
        model.train()  # as the Trainer does (dropout: per-example masks under vmap)
        device = self.args.device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        mask = batch.pop(EXAMPLE_MASK_KEY, None)
        losses = self._accumulate(dp, batch, mask, indices).detach().float()
        if mask is not None:
            losses = losses[mask.to(losses.device)]
        total = losses.sum() if losses.numel() else torch.zeros((), device=losses.device)
        return (total / (dp.expected_batch_size / dp.world_size)).to(device)

    def _accumulate(
        self,
        dp: DPTraining,
        batch: dict[str, Any],
        mask: torch.Tensor | None,
        indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Clip and sum one physical batch into the pending step; return each example's loss
        ``[B]`` for the logged diagnostic (``mask`` and ``indices``: per example)."""
        if dp.privacy_unit == "unit":  # the units come from the sampler through the records
            records = [] if indices is None else [int(i) for i in indices.tolist()]
            return dp.accumulate(batch, example_mask=mask, records=records).loss_values
        return dp.accumulate(batch, example_mask=mask).loss_values

    def _finish_step(self) -> None:
        self.dp_training.finish_step()

    # -- logging ------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ``epsilon``, ``delta``, ``noise_multiplier``, ``sample_rate`` to every log."""
        if self._dp is not None:
            logs = dict(logs)
            logs.pop("grad_norm", None)  # measured before the DP step wrote any gradient
            logs["epsilon"] = self._dp.epsilon()
            logs["delta"] = self._dp.delta
            logs["noise_multiplier"] = self._dp.noise_multiplier
            logs["sample_rate"] = self._dp.sample_rate
        super().log(logs, *args, **kwargs)

    # -- checkpoints --------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model and, once training has started, the DP state beside it; in the
        middle of a logical step no DP state (an earlier one there is removed, with a warning:
        the directory cannot be resumed)."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self._dp is not None and self.args.should_save:
            target = output_dir if output_dir is not None else cast("str", self.args.output_dir)
            save_dp_state(self._dp, Path(target))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        # self.state is the checkpoint's trainer_state.json here (the Trainer loads it first)
        load_dp_state(
            self.dp_training, checkpoint, self.state.global_step, owner=type(self).__name__
        )
        self._drawn = DrawnBatches(self.args.gradient_accumulation_steps, self.args.dp_sampler)
