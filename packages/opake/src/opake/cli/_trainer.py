"""``opake train``: DP-SGD fine-tuning of a causal language model, on Opake's public API.

:func:`plan_run` does every check that needs the data (and none that needs training): the corpus,
the split, the sampling rate, δ, σ for the target ε. :func:`run` then builds the model and trains:

``PoissonSampler`` batch → ``clipped_grad`` (per-example ``vmap(grad)``, clipped to C, summed in
fp32, in microbatches) → ``DPOptimizer`` (Gaussian noise once, ÷ expected batch, optimizer step) →
the accountant records the step. Checkpoints (``opake.dpsgd.checkpoint``) hold the whole state —
model, optimizer, noise generator, sampler position, accountant history — so ``--resume``
continues exactly where the run stopped, with no privacy spending forgotten.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.cli._checks import (
    DivergenceWatch,
    check_model_fits,
    check_writable,
    config_dropout,
    disable_dropout,
    epsilon_note,
    truncation_budget,
)
from opake.cli._data import Corpus, load_corpus, make_blocks, split_blocks, unigram_entropy
from opake.cli._interrupt import StepBoundary
from opake.cli._models import load_model, load_tokenizer, resolve_model
from opake.cli._outputs import plot_metrics, write_json, write_metrics
from opake.cli._progress import make_progress
from opake.cli._settings import DEFAULT_STEPS, RESUME_LOCKED, TrainSettings
from opake.cli._tokenizer import ByteTokenizer
from opake.core.errors import ConfigurationError, OpakePrivacyWarning

if TYPE_CHECKING:
    import torch

__all__ = ["CHECKPOINT_FILE", "PLD_OPTIONS", "SETTINGS_FILE", "RunPlan", "plan_run", "run"]

CHECKPOINT_FILE = "checkpoint.pt"
#: the settings of the run in --out, written before the first step (checked by --resume)
SETTINGS_FILE = "settings.json"
#: PLD discretisation of the run's accountant: pessimistic (ε stays an upper bound), within
#: ~1e-5 relative of the library default and fast enough to report ε after every step
PLD_OPTIONS = {"value_discretization_interval": 1e-3}
_EVAL_BATCH = 64


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

    @property
    def accountant_options(self) -> dict[str, Any]:
        return dict(PLD_OPTIONS) if self.settings.accountant == "pld" else {}

    @property
    def randomness(self) -> str:
        """``"secure"``, or ``"seeded (not private)"`` with ``--reproducible``."""
        return "seeded (not private)" if self.settings.reproducible else "secure"


def _device(name: str) -> torch.device:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigurationError(
            f"--device {name!r}: not a torch device; expected cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigurationError(
            f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigurationError(f"--device {name}: MPS is not available here; use --device cpu")
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
            return False, [note]
        if not supported:
            return False, [
                f"model family {family.name} is skipped here ({why}): the model runs unpatched"
            ]
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


def _encode(tokenizer: Any) -> tuple[Callable[[str], list[int]], int | None, int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode, tokenizer.eos_token_id, tokenizer.vocab_size

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode, tokenizer.eos_token_id, len(tokenizer)


def plan_run(settings: TrainSettings) -> RunPlan:
    """Validate *settings* against the data; everything that can fail before training does.

    Raises:
        ConfigurationError: one line naming the problem (missing or empty data, a target ε no
            noise reaches, a batch larger than the data, an unknown backend, ...).
    """
    import torch

    from opake import accounting

    settings.check()
    out = Path(settings.out)
    checkpoint = out / CHECKPOINT_FILE
    if settings.resume and not checkpoint.is_file():
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
    device = _device(settings.device)
    model_source, model_is_dir = resolve_model(settings.model)
    patch, notes = _check_kernels(settings.kernels, device, _model_type(settings.model))
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

    corpus = load_corpus(settings.data, text_field=settings.text_field)
    tokenizer = load_tokenizer(settings.model)
    encode, eos, vocab = _encode(tokenizer)
    check_model_fits(model_source, model_is_dir, block_size=settings.block_size, vocab_size=vocab)
    rows = make_blocks(corpus, encode, block_size=settings.block_size, eos_token_id=eos)
    if len(rows) < 2:
        raise ConfigurationError(
            f"--data {corpus.name}: {corpus.num_chars} characters give {len(rows)} block(s) of "
            f"{settings.block_size} tokens; need at least 2 (one to train, one to validate): "
            "give more text or a smaller --block-size"
        )
    blocks = torch.tensor(rows, dtype=torch.long)
    train, val = split_blocks(blocks, val_fraction=settings.val_fraction, seed=settings.seed)
    if settings.max_val_blocks is not None:
        val = val[: settings.max_val_blocks]
    n = int(train.shape[0])
    if settings.batch_size > n:
        raise ConfigurationError(
            f"--batch-size {settings.batch_size} exceeds the {n} training blocks; the expected "
            f"Poisson batch must be at most the dataset: use --batch-size {max(1, n // 10)} or "
            "more data"
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
    max_batch = None
    accounting_extra: dict[str, Any] = {}
    if settings.sampler == "fixed":
        max_batch = accounting.max_batch_size_for(
            dataset_size=n,
            sample_rate=q,
            steps=steps,
            truncation_budget=truncation_budget(delta, settings.target_epsilon),
        )
        max_batch = min(max_batch, n)
        accounting_extra = {"max_batch_size": max_batch, "dataset_size": n}
    options = dict(PLD_OPTIONS) if settings.accountant == "pld" else None
    if settings.noise_multiplier is not None:
        sigma = settings.noise_multiplier
    else:
        assert settings.target_epsilon is not None
        try:
            sigma = accounting.calibrate_noise(
                target_epsilon=settings.target_epsilon,
                delta=delta,
                sample_rate=q,
                steps=steps,
                accountant=settings.accountant,
                accountant_options=options,
                **accounting_extra,
            )
        except ConfigurationError as err:
            raise ConfigurationError(
                f"--target-epsilon {settings.target_epsilon} with {steps} steps at q = {q:.4g}: "
                f"{err} (or change --steps / --batch-size)"
            ) from None
    planned = accounting.epsilon(
        sample_rate=q,
        noise_multiplier=sigma,
        steps=steps,
        delta=delta,
        accountant=settings.accountant,
        accountant_options=options,
        **accounting_extra,
    )
    poisson_only = None
    target = settings.target_epsilon
    if accounting_extra and target is not None and planned < target:
        poisson_only = accounting.epsilon(
            sample_rate=q,
            noise_multiplier=sigma,
            steps=steps,
            delta=delta,
            accountant=settings.accountant,
            accountant_options=options,
        )
    note = epsilon_note(
        target=settings.target_epsilon,
        planned=planned,
        poisson_only=poisson_only,
        max_batch=max_batch,
    )
    if note:
        notes.append(note)
    baseline = unigram_entropy(val[:, 1:], vocab)
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
    return RunPlan(
        settings=settings,
        out=out,
        corpus=corpus,
        tokenizer=tokenizer,
        train=train,
        val=val,
        dataset_size=n,
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
        dropout=bool(dropout),
        notes=notes,
    )


def _lr_at(step: int, *, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to *peak*, then cosine decay to 10% of it (a function of the step only)."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _batches(sampler: Any) -> Iterator[list[int]]:
    while True:
        yield from sampler


def _evaluate(
    model: Any,
    val: torch.Tensor,
    device: torch.device,
    autocast: Any,
    forward_kwargs: dict[str, Any],
) -> float:
    import torch

    was_training = model.training
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad(), autocast():
        for chunk in val.split(_EVAL_BATCH):
            x = chunk.to(device)
            out = model(input_ids=x, labels=x, **forward_kwargs)
            tokens = x.shape[0] * (x.shape[1] - 1)
            total += float(out.loss) * tokens
            count += tokens
    model.train(was_training)
    return total / count


def _autocast_factory(precision: str, device: torch.device) -> Callable[[], Any]:
    import torch

    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def _build_model(plan: RunPlan, device: torch.device) -> tuple[Any, Any, Any]:
    from transformers.utils import logging as hf_logging

    s = plan.settings
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        # peft and transformers deprecate each other's helpers; not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        loaded = load_model(
            s.model,
            tokenizer=plan.tokenizer,
            block_size=s.block_size,
            lora_r=s.lora_r,
            lora_alpha=s.lora_alpha,
            seed=s.seed,
        )
    model = loaded.model.to(device)
    report = None
    if plan.patch:
        from opake.patches import apply_model_patches

        report = apply_model_patches(model, kernels=None if s.kernels == "auto" else s.kernels)
    if s.checkpointing:
        from opake.patches import apply_runtime_patches

        apply_runtime_patches()
        base: Any = model.get_base_model() if s.lora_r is not None else model  # type: ignore[operator]
        kwargs = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return loaded, model, report


def _tune_microbatch(
    make: Callable[[int], Any],
    args: tuple[Any, ...],
    plan: RunPlan,
    device: torch.device,
    world_size: int,
) -> tuple[int, str]:
    import torch

    from opake.profiling import tune_microbatch

    # this rank's expected share of the global Poisson batch
    batch = max(1, math.ceil(plan.sample_rate * plan.dataset_size / world_size))
    # random tokens of the real shape: memory and time do not depend on the values, and the
    # tuner never touches the private data
    probe = torch.randint(
        0,
        int(plan.train.max()) + 1,
        (batch, plan.settings.block_size),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    result = tune_microbatch(
        make,
        (*args, probe),
        batch_size=batch,
        device=device,
        steps=1,
        warmup_steps=1,
        compare_smaller=0,
    )
    assert result.microbatch_size is not None
    return result.microbatch_size, result.table()


def run(plan: RunPlan) -> dict[str, Any] | None:
    """Train as planned; write the outputs into ``plan.out`` and return the summary.

    Under ``torchrun`` every rank trains its share of each global Poisson batch (clipped sums
    all-reduced before the noise, noise once, identical updates); rank 0 evaluates and writes
    the outputs and returns the summary, the other ranks return ``None``.
    """
    from opake.dpsgd.distributed import fail_fast, init_distributed

    # CPU runs use gloo; with a CUDA --device the launcher's LOCAL_RANK picks each rank's GPU
    with init_distributed(device="cpu" if plan.device.type == "cpu" else None) as ctx, fail_fast():
        return _train(plan, ctx)


def _train(plan: RunPlan, ctx: Any) -> dict[str, Any] | None:
    import torch

    from opake import accounting
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import (
        DistributedDPOptimizer,
        gather_metrics,
        load_checkpoint_distributed,
        save_checkpoint_distributed,
    )
    from opake.dpsgd.optimizer import autocast_loss
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, padding_mask
    from opake.functional import make_functional
    from opake.profiling import get_memory_stats, reset_peak_memory, step_perf

    s = plan.settings
    main = ctx.is_main
    device = ctx.device if ctx.is_distributed else plan.device
    started = time.perf_counter()
    if main:
        plan.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.seed)
    loaded, model, patch_report = _build_model(plan, device)
    if not s.dropout:
        disable_dropout(model)
    forward_kwargs: dict[str, Any] = {"use_cache": False}
    if patch_report is not None and "linear_cross_entropy" in patch_report.kernels:
        forward_kwargs["loss_only"] = True  # the loss without materialising the logits
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    autocast = _autocast_factory(s.precision, device)

    def loss_fn(
        trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """The loss of ONE example (a block of token ids, no batch dimension)."""
        ids = x.unsqueeze(0)
        return fmodel((trainable, frozen), input_ids=ids, labels=ids, **forward_kwargs).loss

    def batch_losses(
        trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """Per-example losses ``[B]`` of a batch, each over its own tokens only (fp32; the
        forward under bf16 autocast with ``--precision bf16``)."""
        with autocast():
            if forward_kwargs.get("loss_only"):
                # no logits at all: the book-keeping engine takes lm_head's per-example norms
                # from the chunked kernel's recorded loss, vocabulary tile by tile
                params = (trainable, frozen)
                out = fmodel(params, input_ids=x, labels=x, per_example_loss=True, **forward_kwargs)
                return out.loss.float()  # type: ignore[no-any-return]
            out = fmodel((trainable, frozen), input_ids=x, use_cache=False)
            return causal_lm_losses(out.logits, x)

    per_example: Any
    if plan.engine == "vmap":
        per_example = loss_fn
        if s.precision != "fp32":
            dtype = torch.bfloat16 if s.precision == "bf16" else torch.float16
            per_example = autocast_loss(loss_fn, dtype, argnums=0)
    else:
        # one batched forward and backward per microbatch (book-keeping) where it is exact;
        # "auto" falls back to per-example vmap otherwise — the same clipped sum either way
        per_example = BatchedLoss(batch_losses, fmodel)

    def make_grad_fn(microbatch: int | None) -> Any:
        return clipped_grad(
            per_example,
            argnums=0,
            clipping_norm=s.clip,
            batch_argnums=2,
            microbatch_size=microbatch,
            return_aux=True,
            method=plan.engine,
            # dropout: an independent mask per example under vmap
            randomness="different" if plan.dropout else "error",
        )

    tune_report = ""
    microbatch: int | None
    if s.microbatch == "auto":
        microbatch, tune_report = _tune_microbatch(
            make_grad_fn, (trainable, frozen), plan, device, ctx.world_size
        )
    else:
        microbatch = s.microbatch if isinstance(s.microbatch, int) else None
    grad_fn, clip_state = make_grad_fn(microbatch)

    expected_zero = _zero_partner_lora_a(trainable)
    if expected_zero:
        plan.notes.append(
            f"{len(expected_zero)} LoRA A matrices get no gradient on the first step (their B "
            "partners start at zero), so that step moves them by noise alone; this is expected "
            "and costs no privacy"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if s.optimizer == "sgd":
        inner: torch.optim.Optimizer = torch.optim.SGD(
            params, lr=s.lr, momentum=0.9, weight_decay=s.weight_decay
        )
    elif s.optimizer == "adam":
        inner = torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)
    else:
        inner = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    accountant = accounting.make_accountant(s.accountant, **plan.accountant_options)
    shard = ctx.sampler_kwargs()  # every rank draws the global batch and keeps its share
    # secure (default): batch membership from a key drawn on rank 0 and shared, never stored;
    # --reproducible: from --seed (not private)
    keyed: dict[str, Any] = (
        {"seed": s.seed} if s.reproducible else {"randomness": ctx.shared_randomness()}
    )
    if plan.max_batch_size is not None:
        sampler: Any = FixedShapePoissonSampler(
            plan.dataset_size, plan.sample_rate, plan.max_batch_size, **keyed, **shard
        )
    else:
        sampler = PoissonSampler(plan.dataset_size, plan.sample_rate, **keyed, **shard)
    # the sampler gives the divisor (expected global batch q·N) and what the accountant records
    # per step (with the truncation of fixed-shape sampling); every report carries ε(δ) so far.
    # In one process this is exactly DPOptimizer; under torchrun it all-reduces the clipped
    # sums of every rank before adding the noise once.
    dp_opt = DistributedDPOptimizer(
        inner,
        model,
        noise_multiplier=plan.noise_multiplier,
        sampler=sampler,
        accountant=accountant,
        delta=plan.delta,
        # secure (default): a noise key drawn on rank 0 and shared, never stored
        seed=s.seed if s.reproducible else None,
        offload_state=s.offload_optimizer,
    )

    checkpoint_path = plan.out / CHECKPOINT_FILE
    if main and not s.resume:
        write_json(plan.out / SETTINGS_FILE, s.to_dict())
    rows: list[dict[str, Any]] = []
    start_step = 0
    initial_val: float | None = None
    if s.resume:
        ckpt = load_checkpoint_distributed(
            checkpoint_path,
            model=trainable,
            optimizer=dp_opt,
            accountant=accountant,
            sampler=sampler,
            clip_state=clip_state,
        )
        _check_resumed_settings(ckpt.extra.get("settings", {}), s)
        clip_state = ckpt.clip_state
        start_step = ckpt.step
        rows = [dict(r) for r in ckpt.extra.get("metrics", [])]
        initial_val = ckpt.extra.get("initial_val_loss")
    elif main:
        initial_val = _evaluate(model, plan.val, device, autocast, forward_kwargs)

    warmup = s.warmup if s.warmup is not None else max(1, round(0.05 * plan.steps))
    eval_every = s.eval_every or max(1, plan.steps // 10)
    reset_peak_memory(device)
    batches = _batches(sampler)
    bar = make_progress(
        plan.steps,
        initial=start_step,
        enabled=s.progress and main,
        desc="opake train" if not s.reproducible else "opake train [seeded, not private]",
    )

    def save(step: int) -> None:
        save_checkpoint_distributed(
            checkpoint_path,
            step=step,
            model=trainable,
            optimizer=dp_opt,
            accountant=accountant,
            sampler=sampler,
            clip_state=clip_state,
            extra={"settings": s.to_dict(), "metrics": rows, "initial_val_loss": initial_val},
        )

    val_loss: float | None = None
    peak_seen: float | None = None
    # the validation loss above the initial one for 3 evaluations in a row: say so, once
    watch = DivergenceWatch(initial_val, patience=3)
    # a KeyboardInterrupt raised while `at_boundary` leaves a consistent state to checkpoint:
    # no batch drawn, no noise drawn, nothing stepped or accounted for the next step yet
    at_boundary = True
    boundary = StepBoundary(enabled=not ctx.is_distributed)
    try:
        boundary.__enter__()
        for step in range(start_step, plan.steps):
            at_boundary = True
            boundary.check()
            lr = _lr_at(step, steps=plan.steps, peak=s.lr, warmup=warmup)
            at_boundary = False
            for group in inner.param_groups:
                group["lr"] = lr
            indices = next(batches)
            if plan.max_batch_size is not None:
                mask = padding_mask(indices)
                safe = torch.as_tensor(indices, dtype=torch.long).clamp_min(0)
                x = plan.train[safe].to(device)
                call_kwargs: dict[str, Any] = {"example_mask": mask.to(device)}
                real = int(mask.sum())
            else:
                x = plan.train[torch.as_tensor(indices, dtype=torch.long)].to(device)
                call_kwargs = {}
                real = len(indices)
            with step_perf(device, batch_size=real) as perf:
                (grads, aux), clip_state = grad_fn(
                    trainable, frozen, x, state=clip_state, **call_kwargs
                )
                perf.mark("clipped_grad")
                dp_opt.accumulate(grads)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", OpakePrivacyWarning)
                    report = dp_opt.step()
                _reemit(caught, expected_zero, trainable)
                perf.mark("noise_and_update")
            assert report.epsilon is not None
            eps = float(report.epsilon)
            losses = aux.loss_values
            if plan.max_batch_size is not None:
                losses = losses[mask.to(losses.device)]
            result = perf.result
            # diagnostics (not private) of this rank, summed over ranks under torchrun
            figures = {
                "loss_sum": float(losses.sum()),
                "count": float(real),
                "clipped": float(aux.clipping_rate) * real,
                "step_time_sec": result.step_time_sec,
                "memory_peak_gb": result.memory_peak_gb or 0.0,
            }
            if ctx.is_distributed:
                agg = gather_metrics(figures).aggregate()
                figures = {k: agg[k]["max" if k in _MAX_FIGURES else "sum"] for k in figures}
            count = figures["count"]
            train_loss = figures["loss_sum"] / count if count else float("nan")
            done = step + 1
            val_loss = None
            if main and (done % eval_every == 0 or done == plan.steps):
                val_loss = _evaluate(model, plan.val, device, autocast, forward_kwargs)
                diverging = watch.observe(val_loss)
                if diverging:
                    plan.notes.append(f"at step {done}, {diverging}")
                    print(f"\nopake train: warning: {diverging}", file=sys.stderr, flush=True)
            step_time = figures["step_time_sec"]
            peak = result.memory_peak_gb and figures["memory_peak_gb"]
            peak_seen = _max_none([peak_seen, peak])
            rows.append(
                {
                    "step": done,
                    "train_loss": train_loss,
                    "val_loss": val_loss,
                    "epsilon": eps,
                    "batch_size": int(count),
                    "clipping_rate": figures["clipped"] / count if count else 0.0,
                    "step_time_sec": step_time,
                    "samples_per_second": count / step_time if step_time > 0 else None,
                    "peak_memory_gb": peak,
                    "lr": lr,
                }
            )
            bar.set_postfix_str(
                f"loss {train_loss:.3f}  ε {eps:.2f}  "
                f"{count / step_time if step_time > 0 else 0.0:.0f} samples/s  "
                f"peak {_fmt_gb(peak_seen)}",
                refresh=False,
            )
            bar.update(1)
            if done % s.checkpoint_every == 0 and done < plan.steps:
                save(done)
            at_boundary = True
    except KeyboardInterrupt:
        bar.close()
        completed = int(rows[-1]["step"]) if rows else start_step
        if at_boundary and not ctx.is_distributed:
            if completed > start_step:
                save(completed)
            print(
                f"opake train: interrupted after step {completed}; continue with the same "
                "command and --resume",
                file=sys.stderr,
            )
        else:
            print(
                f"opake train: stopped during step {completed + 1}, without saving it; "
                "continue from the last checkpoint with the same command and --resume",
                file=sys.stderr,
            )
        raise
    finally:
        boundary.__exit__(None, None, None)
    bar.close()
    save(plan.steps)
    if not main:
        return None
    if val_loss is None:
        val_loss = _evaluate(model, plan.val, device, autocast, forward_kwargs)
    saved = _save_model(plan, loaded, model)
    mem = get_memory_stats(device)
    summary = _summary(
        plan,
        rows=rows,
        val_loss=val_loss,
        initial_val=initial_val,
        peak_gb=_max_none(r["peak_memory_gb"] for r in rows),
        memory_process_level=mem.process_level,
        loaded=loaded,
        microbatch=microbatch,
        resumed_from=start_step if s.resume else None,
        wall=time.perf_counter() - started,
        saved=saved,
        accountant=accountant,
        patch_report=patch_report,
        world_size=ctx.world_size,
        device=device,
        engine=(getattr(grad_fn, "engine", None), getattr(grad_fn, "engine_reason", None)),
    )
    write_metrics(plan.out / "metrics.csv", rows)
    if s.plots:
        plots = plot_metrics(plan.out, rows, baseline=plan.baseline, delta=plan.delta)
        summary["plots"] = [p.name for p in plots]
    write_json(plan.out / "summary.json", summary)
    if tune_report:
        (plan.out / "microbatch_tuning.txt").write_text(tune_report + "\n", encoding="utf-8")
    return summary


#: per-step figures whose cross-rank aggregate is the maximum (the others are summed)
_MAX_FIGURES = frozenset({"step_time_sec", "memory_peak_gb"})


def _zero_partner_lora_a(trainable: dict[str, torch.Tensor]) -> frozenset[str]:
    """LoRA ``A`` matrices whose ``B`` partner is all zeros (PEFT's initialisation).

    Their gradient is exactly zero until ``B`` moves, so the optimizer's first-step check
    ("all-zero gradient ... updated by noise alone") is expected for them, not a sign that they
    are unused: on the first step they do receive noise alone, which costs no privacy.
    """
    names = set()
    for name in trainable:
        if ".lora_A." in name:
            partner = trainable.get(name.replace(".lora_A.", ".lora_B."))
            if partner is not None and not bool(partner.count_nonzero()):
                names.add(name)
    return frozenset(names)


def _reemit(
    caught: list[warnings.WarningMessage], expected_zero: frozenset[str], names: Iterable[str]
) -> None:
    """Re-issue caught warnings, except a zero-gradient warning naming only *expected_zero*
    among the trainable *names*."""
    names = tuple(names)
    for item in caught:
        message = str(item.message)
        mentioned = {name for name in names if name in message}
        if (
            issubclass(item.category, OpakePrivacyWarning)
            and "all-zero gradient" in message
            and mentioned
            and mentioned <= expected_zero
        ):
            continue
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


def _fmt_gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GB"


def _max_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _check_resumed_settings(saved: Any, current: TrainSettings) -> None:
    if not isinstance(saved, dict):
        raise ConfigurationError("--resume: the checkpoint carries no settings of opake train")
    mine = current.to_dict()
    diffs = [
        f"--{key.replace('_', '-')} {saved.get(key)!r} (saved) vs {mine[key]!r} (given)"
        for key in RESUME_LOCKED
        if saved.get(key) != mine[key]
    ]
    if diffs:
        raise ConfigurationError(
            "--resume: the run was saved with other settings: "
            + "; ".join(diffs)
            + "; resume with the saved run's options"
        )


def _read_settings(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(
            f"--resume: {path} is missing; the directory was not written by opake train"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigurationError(f"--resume: {path} is damaged ({err.msg})") from None


def _save_model(plan: RunPlan, loaded: Any, model: Any) -> dict[str, str]:
    from opake.cli._saving import save_run_model

    return save_run_model(plan.out, loaded, model, plan.tokenizer)


def _summary(
    plan: RunPlan,
    *,
    rows: list[dict[str, Any]],
    val_loss: float,
    initial_val: float | None,
    peak_gb: float | None,
    memory_process_level: bool,
    loaded: Any,
    microbatch: int | None,
    resumed_from: int | None,
    wall: float,
    saved: dict[str, str],
    accountant: Any,
    patch_report: Any,
    world_size: int,
    device: torch.device,
    engine: tuple[str | None, str | None],
) -> dict[str, Any]:
    import torch

    from opake.cli._version import __version__

    s = plan.settings
    tail = rows[-max(1, len(rows) // 10) :]
    train_losses = [r["train_loss"] for r in tail if math.isfinite(r["train_loss"])]
    total_time = sum(r["step_time_sec"] for r in rows)
    total_samples = sum(r["batch_size"] for r in rows)
    epsilon = float(accountant.get_epsilon(plan.delta))
    return {
        "epsilon": epsilon,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "steps": len(rows),
        "train_loss": sum(train_losses) / len(train_losses) if train_losses else None,
        "val_loss": val_loss,
        "samples_per_second": total_samples / total_time if total_time > 0 else None,
        "peak_memory_gb": peak_gb,
        "peak_memory_scope": "process RSS" if memory_process_level else "device allocator",
        "unigram_baseline": plan.baseline,
        "initial_val_loss": initial_val,
        "val_loss_below_baseline": plan.baseline - val_loss,
        "planned_epsilon": plan.planned_epsilon,
        "accountant": s.accountant,
        "randomness": plan.randomness,
        "privacy_unit": (
            f"one training block of {s.block_size} tokens (example-level DP over the training "
            "split; the validation split is not protected)"
        ),
        "clipping_rate_mean": sum(r["clipping_rate"] for r in rows) / max(1, len(rows)),
        "diagnostics_are_private": False,
        "dataset_size": plan.dataset_size,
        "val_blocks": int(plan.val.shape[0]),
        "expected_batch_size": plan.sample_rate * plan.dataset_size,
        "max_batch_size": plan.max_batch_size,
        "microbatch_size": microbatch,
        "corpus": plan.corpus.name,
        "corpus_characters": plan.corpus.num_chars,
        "model_source": loaded.source,
        "parameters": loaded.num_parameters,
        "trainable_parameters": loaded.num_trainable,
        "train_time_sec": total_time,
        "wall_time_sec": wall,
        "resumed_from_step": resumed_from,
        "device": str(device),
        "world_size": world_size,
        "clipping_engine": engine[0],
        "clipping_engine_reason": engine[1],
        "model_patches": None
        if patch_report is None
        else {
            "family": patch_report.family,
            "kernels": {op: use.backend for op, use in patch_report.kernels.items()},
            # the logits-free loss path, for either engine (book-keeping takes lm_head's
            # per-example norms from the kernel's example-grads op)
            "loss_only": "linear_cross_entropy" in patch_report.kernels,
        },
        "outputs": saved,
        "notes": plan.notes,
        "versions": {
            "opake": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": s.to_dict(),
    }
