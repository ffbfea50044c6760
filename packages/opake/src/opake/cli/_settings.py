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
#: settings a resumed run must share with the saved one (data, model, privacy, schedule)
RESUME_LOCKED = (
    "model",
    "data",
    "text_field",
    "block_size",
    "val_fraction",
    "lora_r",
    "lora_alpha",
    "dropout",
    "target_epsilon",
    "noise_multiplier",
    "delta",
    "accountant",
    "clip",
    "batch_size",
    "sampler",
    "steps",
    "epochs",
    "lr",
    "warmup",
    "optimizer",
    "weight_decay",
    "seed",
    "reproducible",
)


@dataclass(frozen=True)
class TrainSettings:
    """Every option of ``opake train`` (see ``opake train --help``)."""

    model: str = "llama-small"
    data: str | None = None
    text_field: str = "text"
    block_size: int = 64
    val_fraction: float = 0.1
    lora_r: int | None = None
    lora_alpha: float | None = None
    dropout: bool = True
    target_epsilon: float | None = 8.0
    noise_multiplier: float | None = None
    delta: float | None = None
    accountant: str = "pld"
    clip: float = 1.0
    batch_size: int = 128
    microbatch: int | str | None = None
    memory_budget: float | None = None
    sampler: str = "poisson"
    steps: int | None = None
    epochs: float | None = None
    lr: float = 2e-2
    warmup: int | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    engine: str = "auto"
    checkpointing: bool = False
    offload_optimizer: bool = False
    kernels: str = "auto"
    precision: str = "fp32"
    device: str = "cpu"
    seed: int = 0
    reproducible: bool = False
    secure_noise: bool = False
    out: str = "opake-run"
    resume: bool = False
    checkpoint_every: int = 50
    eval_every: int | None = None
    max_val_blocks: int | None = 1024
    progress: bool = True
    plots: bool = True

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
                raise ConfigurationError(f"--{_flag(name)} {value}: expected an integer >= 1")
        if self.block_size < 2:
            raise ConfigurationError(f"--block-size {self.block_size}: expected at least 2")
        for name in ("steps", "lora_r", "eval_every", "max_val_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigurationError(f"--{_flag(name)} {value}: expected an integer >= 1")
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
                raise ConfigurationError(f"--{_flag(name)} {value}: expected a finite number > 0")
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
                    f"--{_flag(name)} {getattr(self, name)!r}: expected one of "
                    f"{', '.join(allowed)}{_WHY.get(name, '')}"
                )
        return self


#: why a choice is limited, where the reason is not obvious (appended to the refusal)
_WHY = {
    "sampler": (
        " (ε is computed for Poisson sampling only; a shuffle into batches of one size is not "
        "Poisson sampling, whatever sample rate comes with it)"
    ),
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``opake train`` option to *p* (defaults from :class:`TrainSettings`)."""
    d = TrainSettings()
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model, help=model_help(d.model))
    g.add_argument(
        "--data",
        default=d.data,
        help="text file, JSONL file (one object per line), or a named corpus: pydoc (default: "
        "Python's own documentation), stdlib (Python's source)",
    )
    g.add_argument("--text-field", default=d.text_field, help="JSONL field holding the text")
    g.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per training example (the unit of privacy)",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="fraction of blocks held out for validation",
    )
    g.add_argument(
        "--lora-r",
        type=int,
        default=d.lora_r,
        help="train LoRA adapters of this rank (peft) instead of every weight",
    )
    g.add_argument(
        "--lora-alpha", type=float, default=d.lora_alpha, help="LoRA alpha (default 2 × rank)"
    )
    g.add_argument(
        "--no-dropout",
        dest="dropout",
        action="store_false",
        help="switch off the model's dropout (default: dropout stays active as configured, "
        "with a mask per example; such models train with the vmap engine)",
    )

    g = p.add_argument_group("privacy")
    x = g.add_mutually_exclusive_group()
    x.add_argument(
        "--target-epsilon",
        type=float,
        default=None,
        help=f"calibrate σ to spend this ε over the run (default {d.target_epsilon})",
    )
    x.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="use this σ and report the ε it spends",
    )
    g.add_argument(
        "--delta",
        type=float,
        default=d.delta,
        help="δ of the (ε, δ) guarantee (default 1/N², N = training blocks)",
    )
    g.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default=d.accountant,
        help="privacy accountant (pld: tight, default; rdp: looser)",
    )
    g.add_argument("--clip", type=float, default=d.clip, help="per-example clipping norm C")
    g.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default=d.sampler,
        help="poisson: variable batches (default); fixed: truncated Poisson padded to a static "
        "shape (accounted with its truncation probability); ε is computed for these two only",
    )
    g.add_argument(
        "--reproducible",
        action="store_true",
        help="seed the noise and the Poisson sampling from --seed: bit-for-bit reproducible "
        "and resumable, and NOT private (whoever knows the seed replays the noise and the "
        "batches); default: a secure key from the operating system, never stored",
    )
    g.add_argument(
        "--secure-noise",
        action="store_true",
        help="deprecated: secure noise and sampling are the default (kept so old commands run)",
    )

    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="expected batch size of Poisson sampling (q = batch / N)",
    )
    g.add_argument(
        "--microbatch",
        type=_int_or_auto,
        default=d.microbatch,
        help="examples computed at once: an integer, or 'auto' (the tuner measures sizes that "
        "fit); default: the whole batch when its estimated peak fits in the memory limit, else "
        "microbatches of a power of two sized from the estimate (the plan's memory line says "
        "which, and why); privacy-neutral",
    )
    g.add_argument(
        "--memory-budget",
        type=float,
        default=d.memory_budget,
        metavar="GB",
        help="memory limit in GB for a step's peak, used to choose --microbatch (CPU: the whole "
        "process); default: half of the available memory, or 80%% of it with --microbatch auto",
    )
    x = g.add_mutually_exclusive_group()
    x.add_argument(
        "--steps", type=int, default=None, help=f"logical DP steps (default {DEFAULT_STEPS})"
    )
    x.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="expected passes over the data (steps = epochs / q)",
    )
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="linear warm-up steps before the cosine decay (default: 5%% of the steps)",
    )
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)

    g = p.add_argument_group("memory and speed")
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default=d.engine,
        help="per-example clipping engine: auto (default: book-keeping where exact, else vmap), "
        "vmap, bookkeeping; the same clipped sum either way",
    )
    g.add_argument(
        "--checkpointing",
        action="store_true",
        help="gradient checkpointing of every layer (works under vmap)",
    )
    g.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep the optimizer state in CPU memory",
    )
    g.add_argument(
        "--kernels",
        default=d.kernels,
        metavar="BACKEND",
        help="model patches and their kernels: auto (default: patch supported model families, "
        "kernels chosen per op), none (no model patches), or a backend name for every op "
        "(see opake info)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=d.precision,
        help="compute dtype; clipping, sums and noise stay fp32",
    )
    g.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, mps, ...")

    g = p.add_argument_group("run")
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the model initialisation and the train/validation split (and, with "
        "--reproducible only, of the noise and the sampling)",
    )
    g.add_argument("--out", default=d.out, help="output directory")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out (same settings, same accountant history)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="steps between checkpoints (one is always written at the end)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validation evaluations (default: 10 per run)",
    )
    g.add_argument(
        "--max-val-blocks",
        type=int,
        default=d.max_val_blocks,
        help="evaluate on at most this many validation blocks",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="no PNG plots")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """Build and check the settings from parsed arguments."""
    target = args.target_epsilon
    if target is None and args.noise_multiplier is None:
        target = TrainSettings.target_epsilon
    steps = args.steps
    if steps is None and args.epochs is None:
        steps = DEFAULT_STEPS
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(target_epsilon=target, steps=steps)
    return TrainSettings(**values).check()
