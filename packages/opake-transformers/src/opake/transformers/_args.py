"""``DPTrainingArguments``: ``TrainingArguments`` plus the DP-SGD settings.

The DP settings are one dataclass mixin, :class:`DPArguments`, combined with
``TrainingArguments`` here and with TRL's ``SFTConfig`` / ``DPOConfig`` in
:mod:`opake.transformers.trl`: every DP trainer reads and checks them the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from opake.core.choices import ACCOUNTANTS, ENGINES, SAMPLERS
from opake.core.errors import ConfigurationError

__all__ = ["DPArguments", "DPTrainingArguments"]

_CLIPPING = ("flat", "automatic")


@dataclass
class DPArguments:
    """The DP-SGD fields of every Opake trainer's arguments (a dataclass mixin).

    Combined with a ``TrainingArguments`` subclass, first in the bases:
    ``@dataclass class DPTrainingArguments(DPArguments, TrainingArguments)``. The fields are
    documented on :class:`DPTrainingArguments`; ``__post_init__`` sets ``ignore_data_skip``
    and runs :meth:`check_dp` after the base class's own ``__post_init__``.
    """

    target_epsilon: float | None = field(
        default=None, metadata={"help": "Privacy budget ε (calibrates σ without noise_multiplier)."}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "Noise multiplier σ (noise std / clipping bound)."}
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "δ of the (ε, δ) guarantee; default 1/N²."}
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "C: each example's gradient is clipped to this L2 norm."}
    )
    clipping: str = field(default="flat", metadata={"help": "flat or automatic (AUTO-S)."})
    accountant: str = field(default="pld", metadata={"help": "pld or rdp."})
    dp_sampler: str = field(default="poisson", metadata={"help": "poisson or fixed."})
    engine: str = field(default="auto", metadata={"help": "auto, vmap or bookkeeping."})
    microbatch_size: int | None = field(
        default=None, metadata={"help": "Examples per chunk of a physical batch."}
    )
    privacy_unit_column: str | None = field(
        default=None,
        metadata={
            "help": "Column naming each record's privacy unit (e.g. user_id): user-level DP, "
            "ε per unit (units sampled, each unit's records clipped together)."
        },
    )
    max_records_per_unit: int | None = field(
        default=None,
        metadata={
            "help": "With privacy_unit_column: at most this many records of a unit per step."
        },
    )
    memory_budget_gb: float | None = field(
        default=None,
        metadata={"help": "Peak memory (GiB) the automatic microbatch is held to."},
    )
    reproducible: bool = field(
        default=False,
        metadata={"help": "Seed Poisson sampling and noise from `seed` (not secure)."},
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Off for DP: the per-example clipping is per_sample_max_grad_norm."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # a mixin: TrainingArguments has it
        combined: Any = self  # the TrainingArguments side of the combined class
        combined.ignore_data_skip = True
        self.check_dp()

    def check_dp(self) -> None:
        """Validate the DP fields (raises ``ConfigurationError`` naming the field)."""
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ConfigurationError(
                f"{type(self).__name__} needs target_epsilon (σ calibrated for the planned run) "
                "or noise_multiplier"
            )
        for name in ("target_epsilon", "noise_multiplier", "per_sample_max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ConfigurationError(f"{name}={value!r}: expected a number > 0")
        if self.target_delta is not None and not 0.0 < self.target_delta < 1.0:
            raise ConfigurationError(f"target_delta={self.target_delta!r}: expected 0 < δ < 1")
        if not (isinstance(self.dp_sampler, str) and self.dp_sampler in SAMPLERS):
            sampler: object = self.dp_sampler
            given = repr(sampler) if isinstance(sampler, str) else type(sampler).__name__
            raise ConfigurationError(
                f"dp_sampler={given}: "
                f"expected one of {', '.join(SAMPLERS)} — DPTrainer draws its own Poisson "
                "batches, the only sampling its ε is computed for; a shuffle into batches of one "
                "size (ShuffleSampler, a DataLoader's sampler) is not Poisson sampling, whatever "
                "sample rate comes with it. Use dp_sampler='poisson' (or 'fixed': truncated "
                "Poisson in static shapes)"
            )
        for name, allowed in (
            ("clipping", _CLIPPING),
            ("accountant", ACCOUNTANTS),
            ("engine", ENGINES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigurationError(
                    f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}"
                )
        budget = self.memory_budget_gb
        if budget is not None and not (
            isinstance(budget, int | float) and not isinstance(budget, bool) and budget > 0
        ):
            raise ConfigurationError(
                f"memory_budget_gb={budget!r}: expected a number of GiB > 0 (or None: half of "
                "the memory available)"
            )
        if self.max_records_per_unit is not None and (
            self.privacy_unit_column is None or self.max_records_per_unit < 1
        ):
            raise ConfigurationError(
                f"max_records_per_unit={self.max_records_per_unit!r}: expected an int ≥ 1, "
                "with privacy_unit_column naming the units it caps"
            )
        if self.microbatch_size is not None and self.microbatch_size < 1:
            raise ConfigurationError(f"microbatch_size={self.microbatch_size!r}: expected ≥ 1")


@dataclass
class DPTrainingArguments(DPArguments, TrainingArguments):
    """``TrainingArguments`` for :class:`~opake.transformers.DPTrainer` (DP-SGD).

    A logical DP step is one optimizer step: its Poisson batch has the expected size
    ``per_device_train_batch_size × gradient_accumulation_steps × world size`` and is split
    into ``gradient_accumulation_steps`` physical batches per rank.

    Besides every ``TrainingArguments`` field:

    Attributes:
        target_epsilon: the privacy budget ε. Without ``noise_multiplier`` σ is calibrated so
            that the planned run (``max_steps``, or ``num_train_epochs`` epochs) spends it;
            with ``noise_multiplier`` it only stops training when spent.
        noise_multiplier: σ (noise standard deviation / clipping bound).
        target_delta: δ; default ``1 / N²`` for N training examples.
        per_sample_max_grad_norm: C, each example's gradient is clipped to this L2 norm.
        clipping: ``"flat"`` (clip to C, default) or ``"automatic"`` (AUTO-S normalisation).
        accountant: ``"pld"`` (tight, default) or ``"rdp"``.
        dp_sampler: ``"poisson"`` (variable batch sizes, default) or ``"fixed"`` (truncated
            Poisson in fixed-size padded batches, the truncation accounted in δ). No other
            batch order is accounted: anything else is refused, and so is a training loader
            other than the one ``DPTrainer.get_train_dataloader`` builds.
        engine: per-example engine, ``"auto"`` (default), ``"vmap"`` or ``"bookkeeping"``.
        microbatch_size: examples per chunk inside each physical batch (memory). Default: chosen
            when training starts — the whole physical batch when it is estimated to fit the
            memory, else the largest power of two that does (logged; privacy-neutral).
        memory_budget_gb: the memory (GiB) a physical batch may peak at when the microbatch is
            chosen automatically. Default: half of the memory available.
        reproducible: draw Poisson batches and noise from ``seed`` (bitwise-reproducible runs,
            for tests and debugging). Default ``False``: both come from OS entropy.

    ``max_grad_norm`` defaults to 0 here: the DP clipping is ``per_sample_max_grad_norm``.
    ``ignore_data_skip`` is always on: the DP sampler restores its own position on resume.

    Example:
        >>> from opake.transformers import DPTrainingArguments
        >>> args = DPTrainingArguments(output_dir="out", target_epsilon=8.0,
        ...                            per_sample_max_grad_norm=0.5, report_to="none")
        >>> args.target_epsilon, args.max_grad_norm, args.reproducible
        (8.0, 0.0, False)
    """
