"""The two pieces that tie the Trainer's loop to the DP step: the optimizer the Trainer steps
(:class:`DPStep`, whose ``step()`` is :meth:`DPTraining.finish_step`) and the callback
(:class:`PrivacyBudget`) that binds the DP step to the prepared model, keeps ``state.epoch``
right after a resume and stops training when the budget is spent; and the log line that
describes the DP step when it is built (:func:`log_setup`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, overload

import torch
from transformers import TrainerCallback

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from opake.transformers._dp_mixin import DPTrainerMixin

__all__ = ["DPStep", "PrivacyBudget", "log_setup"]

logger = logging.getLogger("opake.transformers")


class DPStep(torch.optim.Optimizer):
    """What the Trainer steps: the DP step around the optimizer the Trainer built.

    It shares the inner optimizer's parameter groups (the Trainer's LR scheduler sets their
    ``lr``) and state; ``step()`` runs :meth:`DPTraining.finish_step`, which noises the
    accumulated clipped sum once and steps the inner optimizer.
    """

    def __init__(self, inner: torch.optim.Optimizer, trainer: DPTrainerMixin) -> None:
        super().__init__(inner.param_groups, inner.defaults)
        self.state = inner.state
        self.inner = inner
        self._trainer = trainer

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ConfigurationError("DPTrainer's optimizer step takes no closure")
        self._trainer._finish_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def log_setup(training: Any, args: Any) -> None:
    """Log σ, q, δ, C, the randomness and the privacy unit of the DP step just built."""
    column = getattr(args, "privacy_unit_column", None)
    logger.info(
        "DP-SGD: σ = %.4g, q = %.4g (expected batch %g of %d %s), δ = %.3g, C = %g, %s; ε per %s",
        training.noise_multiplier,
        training.sample_rate,
        training.expected_batch_size,
        training.dataset_size,
        "examples" if column is None else f"units ({column})",
        training.delta,
        args.per_sample_max_grad_norm,
        "seeded (reproducible)" if args.reproducible else "secure randomness",
        "example" if column is None else f"unit ({column})",
    )


class PrivacyBudget(TrainerCallback):
    """Binds the DP step to the prepared model; keeps ``state.epoch`` the DP steps taken over
    the steps of an epoch; stops training when the next step would exceed ``target_epsilon``.

    ``state.epoch``: a resumed run skips no batch (``ignore_data_skip``: the DP sampler restores
    its own position), so the Trainer's own count starts the resumed epoch from zero; the
    global step is what was trained."""

    def __init__(self, trainer: DPTrainerMixin) -> None:
        self._trainer = trainer

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        self._trainer._check_train_loader(kwargs.get("train_dataloader"))
        self._trainer._bind_params()
        return control

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        state.epoch = state.global_step / self._trainer._steps_per_epoch()
        dp = self._trainer._dp
        if dp is not None and dp.exhausted and state.global_step < state.max_steps:
            message = (
                f"privacy budget spent: ε = {dp.epsilon():.4g} (δ = {dp.delta:.3g}) after "
                f"{dp.steps} DP steps; one more would exceed target_epsilon = "
                f"{dp.target_epsilon:g}. Training stops at step {state.global_step} of "
                f"{state.max_steps}"
            )
            logger.warning(message)
            self._trainer.privacy_stop_message = message
            control.should_training_stop = True
        return control
