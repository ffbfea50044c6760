"""What a DP trainer lets the ``transformers.Trainer`` release besides the model.

:class:`ReleaseGuard` sits between :class:`~opake.transformers._dp_mixin.DPTrainerMixin` and
the Trainer class in the bases of every Opake trainer:

- **no FLOP count.** The Trainer adds ``6 · parameters · input_ids.numel()`` for every
  physical batch to ``total_flos``, which goes into every checkpoint's ``trainer_state.json``
  and the final metrics. A batch is padded to its longest record, so the differences between
  checkpoints give each Poisson batch's size and show the steps a long record was drawn in —
  the draw ε assumes secret (``include_num_input_tokens_seen`` is refused for the same
  reason). The count is 0 here.
- **no early stopping.** ``EarlyStoppingCallback`` decides when to stop from the un-noised
  evaluation metric: the released model would depend on the evaluation records through no
  noise. It is refused, passed to the constructor or added later
  (``load_best_model_at_end`` is refused with the arguments, :mod:`._refusals`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import Trainer

    _Base = Trainer
else:
    _Base = object

__all__ = ["EARLY_STOPPING", "ReleaseGuard", "check_callback"]

EARLY_STOPPING = (
    "EarlyStoppingCallback stops training by the un-noised evaluation metric, so the released "
    "model would depend on the evaluation records through no noise. Evaluate on public data "
    "and pick the checkpoint yourself after training: every saved checkpoint is DP, and "
    "choosing among them with public data is post-processing"
)


def check_callback(callback: Any, owner: str) -> None:
    """Refuse ``EarlyStoppingCallback`` (a class or an instance, subclasses too).

    >>> from transformers import EarlyStoppingCallback
    >>> check_callback(EarlyStoppingCallback(), "DPTrainer")
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: DPTrainer: EarlyStoppingCallback stops training by ...
    """
    from transformers import EarlyStoppingCallback

    kind = callback if isinstance(callback, type) else type(callback)
    if issubclass(kind, EarlyStoppingCallback):
        raise ConfigurationError(f"{owner}: {EARLY_STOPPING}")


class ReleaseGuard(_Base):
    """The Trainer behaviours above, overridden (a base of every Opake trainer)."""

    def __init__(self, **kwargs: Any) -> None:
        for callback in kwargs.get("callbacks") or ():
            check_callback(callback, type(self).__name__)
        super().__init__(**kwargs)

    def add_callback(self, callback: Any) -> None:
        check_callback(callback, type(self).__name__)
        super().add_callback(callback)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: the Trainer's count grows with each Poisson batch's padded size (see above)."""
        return 0
