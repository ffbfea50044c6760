"""The settings of ``opake train``: defaults, the argument parser, and static validation.

Everything a run depends on is one frozen :class:`TrainSettings`; it is written into
``summary.json`` and into every checkpoint (a resumed run must use the same privacy-relevant
settings).

>>> s = TrainSettings()
>>> s.model, s.batch_size, s.target_epsilon, s.clip
('llama-small', 128, 8.0, 1.0)
>>> TrainSettings(steps=10, epochs=1.0).check()
Traceback (most recent call last):
...
opake.core.errors.ConfigurationError: --steps 10 and --epochs 1.0 both given; pass one of them
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opake.cli._compiling import check_compile
from opake.cli._options import (
    add_arguments,
    flag,
    int_or_auto,
    locked_fields,
    option,
    values_from_args,
)
from opake.cli._records import OBJECTIVES, check_objective
from opake.cli._shard import check_shard
from opake.cli._sources import model_help
from opake.core.choices import ACCOUNTANTS, ENGINES, SAMPLERS
from opake.core.errors import ConfigurationError

__all__ = [
    "DEFAULT_STEPS",
    "PRECISIONS",
    "RESUME_LOCKED",
    "TrainSettings",
    "add_train_arguments",
    "settings_from_args",
]

#: steps of a run when neither --steps nor --epochs is given
DEFAULT_STEPS = 240
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd")
_DEFAULT_EPSILON = 8.0
_MODEL = "llama-small"
_DATA = "model and data"
_PRIVACY = "privacy"
_OPTIM = "optimisation"
_SPEED = "memory and speed"
_RUN = "run"


@dataclass(frozen=True)
class TrainSettings:
    """Every option of ``opake train`` (see ``opake train --help``).

    Each field declares its option once (:func:`~opake.cli._options.option`: section, help,
    converter, choices, and ``locked`` when a resumed run must keep it); the argument table and
    :data:`RESUME_LOCKED` are derived from the fields.
    """

    model: str = option(_MODEL, group=_DATA, help=model_help(_MODEL), locked=True)
    data: str | None = option(
        None,
        group=_DATA,
        help="text file, JSONL file (one object per line), or a named corpus: pydoc (default: "
        "Python's own documentation), stdlib (Python's source)",
        locked=True,
    )
    text_field: str = option("text", group=_DATA, help="JSONL field holding the text", locked=True)
    objective: str = option(
        "auto",
        group=_DATA,
        choices=OBJECTIVES,
        help="what to train: auto (default: a language model on text; SFT on JSONL records with "
        "messages, through the chat template, or prompt/completion: loss on the completion "
        "only), sft, or dpo (JSONL records with prompt, chosen and rejected; never detected)",
        locked=True,
    )
    dpo_beta: float | None = option(
        None,
        group=_DATA,
        type=float,
        metavar="BETA",
        help="with --objective dpo: β, how far the policy may move from the starting model "
        "(default 0.1)",
        locked=True,
    )
    privacy_unit: str | None = option(
        None,
        group=_DATA,
        help="JSONL field naming each record's privacy unit (e.g. user_id): ε then protects "
        "all records of a unit together (user-level DP); blocks never mix units, --batch-size "
        "counts units and validation holds out whole units",
        metavar="FIELD",
        locked=True,
    )
    max_records_per_unit: int | None = option(
        None,
        group=_DATA,
        type=int,
        help="with --privacy-unit: at most this many blocks of one unit per step (a random "
        "subset, drawn with the sampler's randomness; default: all)",
        metavar="K",
        locked=True,
    )
    block_size: int = option(
        64,
        group=_DATA,
        type=int,
        help="tokens per training example (the unit of privacy, unless units are named)",
        locked=True,
    )
    val_fraction: float = option(
        0.1,
        group=_DATA,
        type=float,
        help="fraction of blocks held out for validation",
        locked=True,
    )
    lora_r: int | None = option(
        None,
        group=_DATA,
        type=int,
        help="train LoRA adapters of this rank (peft) instead of every weight",
        locked=True,
    )
    lora_alpha: float | None = option(
        None, group=_DATA, type=float, help="LoRA alpha (default 2 × rank)", locked=True
    )
    dropout: bool = option(
        True,
        group=_DATA,
        help="switch off the model's dropout (default: dropout stays active as configured, "
        "with a mask per example; such models train with the vmap engine)",
        locked=True,
    )
    target_epsilon: float | None = option(
        _DEFAULT_EPSILON,
        group=_PRIVACY,
        type=float,
        exclusive="noise",
        fallback=_DEFAULT_EPSILON,
        help=f"calibrate σ to spend this ε over the run (default {_DEFAULT_EPSILON})",
        locked=True,
    )
    noise_multiplier: float | None = option(
        None,
        group=_PRIVACY,
        type=float,
        exclusive="noise",
        help="use this σ and report the ε it spends",
        locked=True,
    )
    delta: float | None = option(
        None,
        group=_PRIVACY,
        type=float,
        help="δ of the (ε, δ) guarantee (default 1/N², N = training blocks)",
        locked=True,
    )
    accountant: str = option(
        "pld",
        group=_PRIVACY,
        choices=ACCOUNTANTS,
        help="privacy accountant (pld: tight, default; rdp: looser)",
        locked=True,
    )
    clip: float = option(
        1.0, group=_PRIVACY, type=float, help="per-example clipping norm C", locked=True
    )
    batch_size: int = option(
        128,
        group=_OPTIM,
        type=int,
        help="expected batch size of Poisson sampling (q = batch / N)",
        locked=True,
    )
    microbatch: int | str | None = option(
        None,
        group=_OPTIM,
        type=int_or_auto,
        help="examples computed at once: an integer, or 'auto' (the tuner measures sizes that "
        "fit); default: the whole batch when its estimated peak fits in the memory limit, else "
        "microbatches of a power of two sized from the estimate (the plan's memory line says "
        "which, and why); privacy-neutral",
    )
    memory_budget: float | None = option(
        None,
        group=_OPTIM,
        type=float,
        metavar="GB",
        help="memory limit in GB for a step's peak, used to choose --microbatch (CPU: the whole "
        "process); default: half of the available memory, or 80%% of it with --microbatch auto",
    )
    sampler: str = option(
        "poisson",
        group=_PRIVACY,
        choices=SAMPLERS,
        help="poisson: variable batches (default); fixed: truncated Poisson padded to a static "
        "shape (accounted with its truncation probability); ε is computed for these two only",
        locked=True,
    )
    steps: int | None = option(
        None,
        group=_OPTIM,
        type=int,
        exclusive="length",
        fallback=DEFAULT_STEPS,
        help=f"logical DP steps (default {DEFAULT_STEPS})",
        locked=True,
    )
    epochs: float | None = option(
        None,
        group=_OPTIM,
        type=float,
        exclusive="length",
        help="expected passes over the data (steps = epochs / q)",
        locked=True,
    )
    lr: float = option(2e-2, group=_OPTIM, type=float, help="peak learning rate", locked=True)
    warmup: int | None = option(
        None,
        group=_OPTIM,
        type=int,
        help="linear warm-up steps before the cosine decay (default: 5%% of the steps)",
        locked=True,
    )
    optimizer: str = option("adamw", group=_OPTIM, choices=OPTIMIZERS, locked=True)
    weight_decay: float = option(0.0, group=_OPTIM, type=float, locked=True)
    engine: str = option(
        "auto",
        group=_SPEED,
        choices=ENGINES,
        help="per-example clipping engine: auto (default: book-keeping where exact, else vmap), "
        "vmap, bookkeeping; the same clipped sum either way",
    )
    compile: bool = option(
        False,
        group=_SPEED,
        help="compile the DP step with torch.compile (book-keeping: its forward and backward; "
        "vmap: the whole step): each batch runs as chunks of one shape (the microbatch, padded "
        "and masked), the first steps compile (seconds to minutes); privacy-neutral",
    )
    shard: bool = option(
        False,
        group=_SPEED,
        help="under torchrun: shard every decoder layer over the ranks (FSDP2 per-layer sharded "
        "compute, book-keeping engine, the model unpatched); privacy-neutral",
        locked=True,
    )
    checkpointing: bool = option(
        False, group=_SPEED, help="gradient checkpointing of every layer (works under vmap)"
    )
    offload_optimizer: bool = option(
        False, group=_SPEED, help="keep the optimizer state in CPU memory"
    )
    kernels: str = option(
        "auto",
        group=_SPEED,
        metavar="BACKEND",
        help="model patches and their kernels: auto (default: patch supported model families, "
        "kernels chosen per op), none (no model patches), or a backend name for every op "
        "(see opake info)",
    )
    precision: str = option(
        "fp32",
        group=_SPEED,
        choices=PRECISIONS,
        help="compute dtype; clipping, sums and noise stay fp32",
    )
    device: str = option("cpu", group=_SPEED, help="cpu, cuda, cuda:1, mps, ...")
    seed: int = option(
        0,
        group=_RUN,
        type=int,
        help="seed of the model initialisation and the train/validation split (and, with "
        "--reproducible only, of the noise and the sampling)",
        locked=True,
    )
    reproducible: bool = option(
        False,
        group=_PRIVACY,
        help="seed the noise and the Poisson sampling from --seed: bit-for-bit reproducible "
        "and resumable, and NOT private (whoever knows the seed replays the noise and the "
        "batches); default: a secure key from the operating system, never stored",
        locked=True,
    )
    secure_noise: bool = option(
        False,
        group=_PRIVACY,
        help="deprecated: secure noise and sampling are the default (kept so old commands run)",
    )
    out: str = option("opake-run", group=_RUN, help="output directory")
    resume: bool = option(
        False,
        group=_RUN,
        help="continue the run saved in --out (same settings, same accountant history)",
    )
    checkpoint_every: int = option(
        50,
        group=_RUN,
        type=int,
        help="steps between checkpoints (one is always written at the end)",
    )
    eval_every: int | None = option(
        None,
        group=_RUN,
        type=int,
        help="steps between validation evaluations (default: 10 per run)",
    )
    max_val_blocks: int | None = option(
        1024,
        group=_RUN,
        type=int,
        help="evaluate on at most this many validation blocks",
    )
    progress: bool = option(True, group=_RUN, help="no progress bar")
    plots: bool = option(True, group=_RUN, help="no PNG plots")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        """Rebuild settings saved by :meth:`to_dict` (unknown keys are an error)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigurationError(
                f"saved settings have unknown keys {unknown}; they were written by another "
                "version of opake train"
            )
        return cls(**dict(data))

    def _check_combinations(self) -> None:
        """``--privacy-unit`` and ``--max-records-per-unit``, ``--compile``, ``--objective``
        and ``--dpo-beta``: what goes with them."""
        check_compile(self)
        check_shard(self)
        check_objective(self)
        if self.max_records_per_unit is not None and self.privacy_unit is None:
            raise ConfigurationError(
                f"--max-records-per-unit {self.max_records_per_unit} without --privacy-unit: "
                "the cap counts the blocks of one unit; name the unit's JSONL field with "
                "--privacy-unit FIELD"
            )
        if self.privacy_unit is not None and self.sampler == "fixed":
            raise ConfigurationError(
                "--privacy-unit with --sampler fixed: fixed-shape sampling draws records, not "
                "units (a unit brings a variable number of blocks); use --sampler poisson"
            )

    def check(self) -> TrainSettings:
        """Validate what can be checked without data or a model; returns self.

        Raises:
            ConfigurationError: the first problem found, in one line.
        """
        if self.steps is not None and self.epochs is not None:
            raise ConfigurationError(
                f"--steps {self.steps} and --epochs {self.epochs} both given; pass one of them"
            )
        if self.target_epsilon is not None and self.noise_multiplier is not None:
            raise ConfigurationError(
                f"--target-epsilon {self.target_epsilon} and --noise-multiplier "
                f"{self.noise_multiplier} both given; pass one (σ is calibrated from the target, "
                "or ε is computed from σ)"
            )
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ConfigurationError("give --target-epsilon or --noise-multiplier")
        if self.reproducible and self.secure_noise:
            raise ConfigurationError(
                "--reproducible and --secure-noise contradict each other: --reproducible seeds "
                "the noise and the sampling from --seed (not private); secure randomness is the "
                "default, so drop one of them"
            )
        for name in ("block_size", "batch_size", "checkpoint_every"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigurationError(f"--{flag(name)} {value}: expected an integer >= 1")
        if self.block_size < 2:
            raise ConfigurationError(f"--block-size {self.block_size}: expected at least 2")
        self._check_combinations()
        for name in ("steps", "lora_r", "eval_every", "max_val_blocks", "max_records_per_unit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigurationError(f"--{flag(name)} {value}: expected an integer >= 1")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigurationError(f"--warmup {self.warmup}: expected an integer >= 0")
        for name in (
            "clip",
            "lr",
            "target_epsilon",
            "noise_multiplier",
            "epochs",
            "lora_alpha",
            "memory_budget",
        ):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigurationError(f"--{flag(name)} {value}: expected a finite number > 0")
        if self.weight_decay < 0:
            raise ConfigurationError(f"--weight-decay {self.weight_decay}: expected >= 0")
        if self.delta is not None and not 0.0 < self.delta < 1.0:
            raise ConfigurationError(f"--delta {self.delta}: expected a probability in (0, 1)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigurationError(
                f"--val-fraction {self.val_fraction}: expected a fraction strictly between 0 and 1"
            )
        if isinstance(self.microbatch, int):
            if self.microbatch < 1:
                raise ConfigurationError(
                    f"--microbatch {self.microbatch}: expected an integer >= 1 or 'auto'"
                )
            if self.microbatch > self.batch_size:
                raise ConfigurationError(
                    f"--microbatch {self.microbatch} is larger than --batch-size "
                    f"{self.batch_size}; a microbatch is a chunk of the batch: pass at most "
                    f"{self.batch_size} (or 'auto')"
                )
        elif self.microbatch not in (None, "auto"):
            raise ConfigurationError(
                f"--microbatch {self.microbatch!r}: expected an integer >= 1 or 'auto'"
            )
        for name, allowed in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("sampler", SAMPLERS),
            ("accountant", ACCOUNTANTS),
            ("engine", ENGINES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigurationError(
                    f"--{flag(name)} {getattr(self, name)!r}: expected one of "
                    f"{', '.join(allowed)}{_WHY.get(name, '')}"
                )
        return self


#: settings a resumed run must share with the saved one (data, model, privacy, schedule): the
#: fields declared ``locked=True``, in field order
RESUME_LOCKED = locked_fields(TrainSettings)

#: why a choice is limited, where the reason is not obvious (appended to the refusal)
_WHY = {
    "sampler": (
        " (ε is computed for Poisson sampling only; a shuffle into batches of one size is not "
        "Poisson sampling, whatever sample rate comes with it)"
    ),
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``opake train`` option to *p* (derived from the fields of
    :class:`TrainSettings`)."""
    add_arguments(p, TrainSettings)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """Build and check the settings from parsed arguments (``--target-epsilon`` and
    ``--steps`` take their fallback when neither of their exclusive pair is given)."""
    return TrainSettings(**values_from_args(args, TrainSettings)).check()
