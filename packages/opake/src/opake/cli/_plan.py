"""The plan of an ``opake train`` run: every check that needs the data and none that trains.

:func:`plan_run` validates the settings against the corpus, the split, the sampling rate, δ and
σ for the target ε, before any model is built; the resume checks compare the saved settings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.cli._blocks import load_blocks
from opake.cli._checks import (
    check_writable,
    config_dropout,
    epsilon_note,
)
from opake.cli._compiling import unpatched
from opake.cli._data import Corpus, unigram_entropy
from opake.cli._models import resolve_model
from opake.cli._options import locked_fields
from opake.cli._records import PostTraining, check_post, post_baseline
from opake.cli._settings import DEFAULT_STEPS, TrainSettings
from opake.core.choices import TRAINING_PLD_OPTIONS
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["CHECKPOINT_FILE", "PLD_OPTIONS", "SETTINGS_FILE", "RunPlan", "plan_run"]

_log = logging.getLogger("opake.cli")

CHECKPOINT_FILE = "checkpoint.pt"
#: the settings of the run in --out, written before the first step (checked by --resume)
SETTINGS_FILE = "settings.json"
#: PLD discretisation of the run's accountant: pessimistic (ε stays an upper bound), within
#: ~1e-5 relative of the library default and fast enough to report ε after every step
PLD_OPTIONS = dict(TRAINING_PLD_OPTIONS)


@dataclass
class RunPlan:
    """A validated run: the data, the privacy parameters, and where the outputs go."""

    settings: TrainSettings
    out: Path
    corpus: Corpus
    tokenizer: Any
    train: torch.Tensor
    val: torch.Tensor
    dataset_size: int
    sample_rate: float
    steps: int
    delta: float
    noise_multiplier: float
    planned_epsilon: float
    baseline: float
    max_batch_size: int | None
    device: torch.device
    patch: bool = False
    engine: str = "auto"
    #: the model keeps dropout active (per-example masks: vmap with randomness="different")
    dropout: bool = False
    notes: list[str] = field(default_factory=list)
    #: each training block's privacy unit (``--privacy-unit``), else ``None`` (a block is one)
    units: list[str] | None = None
    #: post-training records' labels (-100: not a target), shaped as ``train`` / ``val``
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None
    #: what the post-training records are (SFT or DPO), else ``None`` (language modelling)
    post: PostTraining | None = None

    @property
    def population(self) -> int:
        """What Poisson sampling draws from and ε protects: units, or training blocks."""
        return self.dataset_size if self.units is None else len(set(self.units))

    @property
    def unit_name(self) -> str:
        """The protected unit, as reports name it: the unit field, ``"record"`` (SFT, DPO),
        or ``"example"``."""
        if self.settings.privacy_unit is not None:
            return self.settings.privacy_unit
        return "example" if self.post is None else "record"

    @property
    def baseline_name(self) -> str:
        """What the validation loss is compared with."""
        if self.post is not None and self.post.objective == "dpo":
            return "starting model's DPO loss (ln 2)"
        return "unigram baseline"

    @property
    def accountant_options(self) -> dict[str, Any]:
        return dict(PLD_OPTIONS) if self.settings.accountant == "pld" else {}

    def training_options(self) -> dict[str, Any]:
        """The ``DPTraining`` keywords this plan decides (σ, q, δ, C, the engine, accountant,
        optimizer offload): one place for ``opake train`` and ``opake audit``, which add what
        is their own (the data or the data and canaries, the sampler's slots, the seed)."""
        s = self.settings
        return {
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "clipping_norm": s.clip,
            "engine": self.engine,
            "accountant": s.accountant,
            "accountant_options": self.accountant_options,
            "offload_state": s.offload_optimizer,
        }

    @property
    def randomness(self) -> str:
        """``"secure"``, or ``"seeded (not private)"`` with ``--reproducible``."""
        return "seeded (not private)" if self.settings.reproducible else "secure"


def resolve_device(name: str, *, auto: bool = False) -> torch.device:
    """``--device NAME`` as a ``torch.device`` that is usable here (one-line error otherwise).

    With *auto*, ``"auto"`` picks CUDA, then MPS, then the CPU.

    >>> resolve_device("cpu").type
    'cpu'
    """
    import torch

    expected = ("auto, " if auto else "") + "cpu, cuda, cuda:N or mps"
    if auto and name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigurationError(
            f"--device {name!r}: not a torch device; expected {expected}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigurationError(
            f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigurationError(f"--device {name}: MPS is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigurationError(f"--device {name}: expected {expected}")
    return device


def _model_type(spec: str) -> str | None:
    source, is_dir = resolve_model(spec)
    if not is_dir:
        return "llama"
    try:
        config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigurationError(f"--model {spec}: cannot read config.json ({err})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def _check_kernels(
    name: str, device: torch.device, model_type: str | None
) -> tuple[bool, list[str]]:
    """Validate ``--kernels`` against the installed backends and model families.

    Returns whether to apply the model patches, and notes for the user.
    """
    from opake.core.plugins import kernel_backends, model_families

    if name == "none":
        return False, []
    families = model_families()
    family = families.get(model_type) if model_type else None
    supported, why = family.supported() if family is not None else (False, "")
    if name == "auto":
        if family is None:
            note = (
                f"no Opake model family for model_type {model_type!r}: the model runs unpatched "
                "(no loss-only forward, no kernels)"
            )
            _log.info("--kernels auto: %s", note)
            return False, [note]
        if not supported:
            note = f"model family {family.name} is skipped here ({why}): the model runs unpatched"
            _log.info("--kernels auto: %s", note)
            return False, [note]
        _log.info("--kernels auto: model_type %r -> model family %s", model_type, family.name)
        return True, []
    backends = kernel_backends()
    if name not in backends:
        raise ConfigurationError(
            f"--kernels {name!r}: unknown kernel backend; installed: "
            f"{', '.join(sorted(backends)) or '(none)'}, or auto / none (see opake info)"
        )
    backend = backends[name]
    if device.type not in backend.devices:
        raise ConfigurationError(
            f"--kernels {name}: the backend runs on {', '.join(backend.devices)}, not on "
            f"{device.type}; pick another backend or --device"
        )
    if not backend.is_available():
        raise ConfigurationError(
            f"--kernels {name}: the backend is installed but not available here (see opake info)"
        )
    if family is None or not supported:
        raise ConfigurationError(
            f"--kernels {name}: model_type {model_type!r} has no supported Opake model family "
            f"({why or 'none registered'}), so no kernels can be patched in; use --kernels none"
        )
    return True, []


def plan_run(settings: TrainSettings) -> RunPlan:
    """Validate *settings* against the data; everything that can fail before training does.

    Raises:
        ConfigurationError: one line naming the problem (missing or empty data, a target ε no
            noise reaches, a batch larger than the data, an unknown backend, ...).
    """
    settings.check()
    out = _check_out(settings)
    device = resolve_device(settings.device)
    model_source, model_is_dir = resolve_model(settings.model)
    patch, notes = _check_kernels(settings.kernels, device, _model_type(settings.model))
    patch = unpatched(settings, patch, notes)  # --compile: the patched forward does not trace
    _check_environment(settings, device, notes)
    data = load_blocks(settings, model_source, model_is_dir, notes)
    train, val, units = data.train, data.val, data.units
    # what Poisson sampling draws and ε protects: training blocks (or records), or units with
    # all their blocks
    n = int(train.shape[0]) if units is None else len(set(units))
    what = "training blocks" if units is None else f"units ({settings.privacy_unit})"
    noun = "blocks" if units is None else "units"
    if data.post is not None:
        what, noun = "training records", "records"
    if settings.batch_size > n:
        raise ConfigurationError(
            f"--batch-size {settings.batch_size} exceeds the {n} {what}; the expected "
            f"Poisson batch must be at most the dataset: pass a --batch-size of at most {n} "
            f"(e.g. --batch-size {max(1, n // 10)}, a tenth of the {noun}: each step then samples "
            "about 10% of the data), or give more data"
        )
    q = settings.batch_size / n
    if settings.steps is not None:
        steps = settings.steps
    elif settings.epochs is not None:
        steps = max(1, math.ceil(settings.epochs / q))
    else:
        steps = DEFAULT_STEPS
    delta = settings.delta if settings.delta is not None else 1.0 / n**2
    if delta >= 1.0 / n:
        notes.append(
            f"δ = {delta:.3g} is not below 1/N = {1.0 / n:.3g}: such a δ allows leaking some "
            "examples outright; prefer δ ≪ 1/N (the default is 1/N²)"
        )
    sigma, planned, max_batch = _privacy(settings, n=n, q=q, steps=steps, delta=delta, notes=notes)
    engine, dropout = _engine(settings, model_source, model_is_dir, notes)
    if data.post is not None:
        check_post(data.post, precision=settings.precision, dropout=dropout)
    baseline = (
        unigram_entropy(val[:, 1:], data.vocab)
        if data.post is None
        else post_baseline(data.post, data.val_labels, data.vocab)
    )
    return RunPlan(
        settings=settings,
        out=out,
        corpus=data.corpus,
        tokenizer=data.tokenizer,
        train=train,
        val=val,
        dataset_size=int(train.shape[0]),
        sample_rate=q,
        steps=steps,
        delta=delta,
        noise_multiplier=sigma,
        planned_epsilon=planned,
        baseline=baseline,
        max_batch_size=max_batch,
        device=device,
        patch=patch,
        engine=engine,
        dropout=dropout,
        notes=notes,
        units=units,
        train_labels=data.train_labels,
        val_labels=data.val_labels,
        post=data.post,
    )


def _check_out(settings: TrainSettings) -> Path:
    """``--out`` and ``--resume``: a new run in a free, writable directory, or a saved one."""
    out = Path(settings.out)
    checkpoint = out / CHECKPOINT_FILE
    if settings.resume and not checkpoint.exists():  # --shard: a directory of shards
        raise ConfigurationError(
            f"--resume: {checkpoint} does not exist; start the run without --resume, or point "
            "--out at the directory of the run to continue"
        )
    if settings.resume:
        _check_resumed_settings(_read_settings(out / SETTINGS_FILE), settings)
    if not settings.resume and checkpoint.exists():
        raise ConfigurationError(
            f"--out {out} already holds a run ({CHECKPOINT_FILE}); pass --resume to continue it "
            "or choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"--out {out}: exists and is not a directory")
    check_writable(out)
    return out


def _check_environment(settings: TrainSettings, device: torch.device, notes: list[str]) -> None:
    """Options that need something of this machine: fp16 on an accelerator, matplotlib, peft."""
    if settings.secure_noise:
        notes.append(
            "--secure-noise is deprecated and has no effect: noise and sampling are secure by "
            "default (--reproducible is the explicit, non-private alternative)"
        )
    if settings.precision == "fp16" and device.type == "cpu":
        raise ConfigurationError(
            "--precision fp16 on cpu: fp16 autocast is for accelerators; use --precision bf16 "
            "(or fp32) on the CPU"
        )
    if settings.plots and importlib.util.find_spec("matplotlib") is None:
        raise ConfigurationError(
            "the loss and ε plots need matplotlib: pip install 'opake[plot]', or pass --no-plots"
        )
    if settings.lora_r is not None:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "--lora-r needs the peft library: pip install 'opake[peft]'"
            ) from None


def _privacy(
    settings: TrainSettings, *, n: int, q: float, steps: int, delta: float, notes: list[str]
) -> tuple[float, float, int | None]:
    """σ (given, or calibrated to the target ε), the planned ε, and B_max of fixed sampling."""
    from opake import accounting

    max_batch = None
    accounting_extra: dict[str, Any] = {}
    if settings.sampler == "fixed":
        max_batch = accounting.fixed_shape_slots(
            dataset_size=n,
            sample_rate=q,
            steps=steps,
            delta=delta,
            target_epsilon=settings.target_epsilon,
        )
        accounting_extra = {"max_batch_size": max_batch, "dataset_size": n}
    options = dict(PLD_OPTIONS) if settings.accountant == "pld" else None
    schedule: dict[str, Any] = {
        "sample_rate": q,
        "steps": steps,
        "delta": delta,
        "accountant": settings.accountant,
        "accountant_options": options,
    }
    if settings.noise_multiplier is not None:
        sigma = settings.noise_multiplier
    else:
        assert settings.target_epsilon is not None
        try:
            sigma = accounting.calibrate_noise(
                target_epsilon=settings.target_epsilon, **schedule, **accounting_extra
            )
        except ConfigurationError as err:
            raise ConfigurationError(
                f"--target-epsilon {settings.target_epsilon} with {steps} steps at q = {q:.4g}: "
                f"{err} (or change --steps / --batch-size)"
            ) from None
    planned = accounting.epsilon(noise_multiplier=sigma, **schedule, **accounting_extra)
    poisson_only = None
    target = settings.target_epsilon
    if accounting_extra and target is not None and planned < target:
        poisson_only = accounting.epsilon(noise_multiplier=sigma, **schedule)
    note = epsilon_note(
        target=target, planned=planned, poisson_only=poisson_only, max_batch=max_batch
    )
    if note:
        notes.append(note)
    return sigma, planned, max_batch


def _engine(
    settings: TrainSettings, model_source: Any, model_is_dir: bool, notes: list[str]
) -> tuple[str, bool]:
    """The clipping engine (fp16 and dropout need vmap) and whether dropout stays active."""
    engine = settings.engine
    if settings.precision == "fp16":
        # fp16 needs a loss scale removed from each example's gradient before clipping:
        # autocast_loss does that around the vmap engine's one-example loss
        if engine == "bookkeeping":
            raise ConfigurationError(
                "--engine bookkeeping with --precision fp16: fp16 needs a per-example loss "
                "scale, which the vmap engine applies; use --engine vmap or auto, or --precision "
                "bf16 (book-keeping runs under bf16 autocast)"
            )
        engine = "vmap"
    dropout = config_dropout(model_source, model_is_dir) if settings.dropout else {}
    if dropout:
        listed = ", ".join(f"{k}={v:g}" for k, v in dropout.items())
        if engine == "bookkeeping":
            raise ConfigurationError(
                f"--engine bookkeeping with dropout ({listed}): book-keeping's per-example check "
                "cannot be validated under random masks; use --engine vmap or auto (dropout per "
                "example), or --no-dropout"
            )
        engine = "vmap"
        notes.append(
            f"dropout stays active as configured ({listed}), with an independent mask per "
            "example: the vmap engine clips these per-example gradients (book-keeping's check "
            "cannot validate under random masks); --no-dropout switches dropout off"
        )
    elif not settings.dropout:
        notes.append("dropout switched off (--no-dropout)")
    return engine, bool(dropout)


def _check_resumed_settings(saved: Any, current: TrainSettings) -> None:
    if not isinstance(saved, dict):
        raise ConfigurationError("--resume: the checkpoint carries no settings of opake train")
    mine = current.to_dict()
    # a setting an earlier version did not have yet: that run had its default
    before = {f.name: f.default for f in dataclasses.fields(current)}
    diffs = [
        f"--{key.replace('_', '-')} {saved.get(key, before[key])!r} (saved) vs {mine[key]!r} "
        "(given)"
        for key in locked_fields(type(current))  # the fields declared locked=True
        if saved.get(key, before[key]) != mine[key]
    ]
    if diffs:
        raise ConfigurationError(
            "--resume: the run was saved with other settings: "
            + "; ".join(diffs)
            + "; resume with the saved run's options"
        )


def _read_settings(path: Path) -> object:  # any JSON value: the caller checks it
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(
            f"--resume: {path} is missing; the directory was not written by opake train"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigurationError(f"--resume: {path} is damaged ({err.msg})") from None
