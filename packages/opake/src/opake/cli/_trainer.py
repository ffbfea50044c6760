"""``opake train``: DP-SGD fine-tuning of a causal language model, on Opake's public API.

:func:`plan_run` does every check that needs the data (and none that needs training): the corpus,
the split, the sampling rate, δ, σ for the target ε. :func:`run` then builds the model and trains
with one :class:`~opake.dpsgd.training.DPTraining`, the DP step composed once:

Poisson batch → ``clipped_grad`` (per-example gradients, clipped to C, summed in fp32, in
microbatches) → the DP optimizer (Gaussian noise once, ÷ expected batch, optimizer step) → the
accountant records the step. Checkpoints (``DPTraining.save``) hold the whole state — model,
optimizer, noise generator, sampler position, accountant history — so ``--resume`` continues
exactly where the run stopped, with no privacy spending forgotten.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.cli._checks import DivergenceWatch, disable_dropout, watch_divergence
from opake.cli._compiling import compile_line
from opake.cli._dp_step import dp_training
from opake.cli._fingerprint import check_resumed_data, data_fingerprint
from opake.cli._interrupt import StepBoundary, interrupted_before_training
from opake.cli._memory import MicrobatchChoice, microbatch_for_run
from opake.cli._outputs import plot_metrics, write_json, write_metrics
from opake.cli._plan import (
    CHECKPOINT_FILE,
    PLD_OPTIONS,
    SETTINGS_FILE,
    RunPlan,
    _check_resumed_settings,
    plan_run,
)
from opake.cli._posttrain import PostStep, run_loss
from opake.cli._progress import make_progress, step_postfix
from opake.cli._setup import (
    _autocast_factory,
    _build_model,
    _evaluate,
    _reemit,
    _zero_partner_lora_a,
    forward_options,
    inner_optimizer,
)
from opake.cli._shard import full_model, prepare_sharded
from opake.cli._summary import _max_none, _save_model, _summary
from opake.core.errors import OpakePrivacyWarning

if TYPE_CHECKING:
    import torch

__all__ = ["CHECKPOINT_FILE", "PLD_OPTIONS", "SETTINGS_FILE", "RunPlan", "plan_run", "run"]

#: per-step figures whose cross-rank aggregate is the maximum (the others are summed)
_MAX_FIGURES = frozenset({"step_time_sec", "memory_peak_gb"})


def _lr_at(step: int, *, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to *peak*, then cosine decay to 10% of it (a function of the step only)."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class _Run:
    """A run being trained: the plan, the model, the DP step, and the metrics so far."""

    plan: RunPlan
    ctx: Any
    device: torch.device
    loaded: Any
    model: Any
    patch_report: Any
    trainable: dict[str, torch.Tensor]
    forward_kwargs: dict[str, Any]
    autocast: Any
    training: Any
    inner: Any
    expected_zero: frozenset[str]
    microbatch: MicrobatchChoice
    #: SFT or DPO records: their loss, batches and validation (``None``: text blocks)
    post: PostStep | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    #: --out did not exist before this run
    created_out: bool = False
    initial_val: float | None = None

    @cached_property
    def data_sha256(self) -> str:
        """The training data's fingerprint (once per run; every checkpoint carries it)."""
        return data_fingerprint(self.plan)

    @property
    def checkpoint(self) -> Path:
        return self.plan.out / CHECKPOINT_FILE

    @property
    def evaluates(self) -> bool:
        """Rank 0 evaluates; with ``--shard`` every rank (each forward gathers the layers)."""
        return bool(self.ctx.is_main or self.plan.settings.shard)

    def evaluate(self) -> float:
        if self.post is not None:
            return self.post.evaluate()
        return _evaluate(self.model, self.plan.val, self.device, self.autocast, self.forward_kwargs)

    def save(self) -> None:
        """Checkpoint at the current step boundary (every rank calls it; rank 0 writes)."""
        self.training.save(
            self.checkpoint,  # --shard: a directory of shards
            model=None if self.plan.settings.shard else self.trainable,
            extra={
                "settings": self.plan.settings.to_dict(),
                "data_sha256": self.data_sha256,
                "metrics": self.rows,
                "initial_val_loss": self.initial_val,
            },
        )


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
    started = time.perf_counter()
    created = not plan.out.exists()
    try:
        r = _prepare(plan, ctx)
        _start(r)
    except KeyboardInterrupt:
        if ctx.is_main:
            _interrupted_before_training(plan, created=created)
        raise
    r.created_out = created
    val_loss = _loop(r)
    r.save()
    if val_loss is None and r.evaluates:
        val_loss = r.evaluate()
    # the model rank 0 saves: with --shard gathered from every rank (a collective)
    trained = full_model(plan, r.model, ctx.is_main) if plan.settings.shard else r.model
    if not ctx.is_main or val_loss is None:
        return None
    return _finish(r, val_loss, wall=time.perf_counter() - started, trained=trained)


def _prepare(plan: RunPlan, ctx: Any) -> _Run:
    """Build the model, its per-example loss and the DP step (:func:`dp_training`), over the
    whole model or, with ``--shard``, over the sharded one (:func:`prepare_sharded`)."""
    import torch

    from opake.dpsgd.optimizer import lora_a_note
    from opake.functional import make_functional

    s = plan.settings
    device = ctx.device if ctx.is_distributed else plan.device
    torch.manual_seed(s.seed)
    loaded, model, patch_report = _build_model(plan, device)
    if not s.dropout:
        disable_dropout(model)
    forward_kwargs = forward_options(patch_report)
    autocast = _autocast_factory(s.precision, device)
    run = partial(
        _Run,
        plan=plan,
        ctx=ctx,
        device=device,
        loaded=loaded,
        model=model,
        patch_report=patch_report,
        forward_kwargs=forward_kwargs,
        autocast=autocast,
    )
    if s.shard:
        return run(**prepare_sharded(plan, ctx, model, forward_kwargs, autocast))
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss, post = run_loss(
        plan,
        fmodel,
        model,
        (trainable, frozen),
        forward_kwargs=forward_kwargs,
        autocast=autocast,
        device=device,
        world_size=ctx.world_size,
    )
    # dropout: an independent mask per example under vmap
    randomness = "different" if plan.dropout else "error"
    choice = _microbatch(
        plan, ctx, loss, (trainable, frozen), device=device, randomness=randomness, post=post
    )
    rows = 1 if post is None else post.rows  # a DPO record is two rows
    expected_zero = _zero_partner_lora_a(trainable)
    if expected_zero:
        plan.notes.append(lora_a_note(sorted(expected_zero)))
    inner = inner_optimizer(plan, model)
    training = dp_training(
        plan,
        loss,
        inner,
        trainable,
        module=model,
        microbatch_size=None if choice.microbatch is None else choice.microbatch * rows,
        args=(frozen,),
        randomness=randomness,
        # fixed-shape sampling: B_max slots
        sampler="poisson" if plan.max_batch_size is None else "fixed",
        max_batch_size=plan.max_batch_size,
        # --privacy-unit: units sampled and each clipped as one (records= at every step)
        privacy_units=plan.units,
        max_records_per_unit=s.max_records_per_unit,
        compile=s.compile,
    )
    return run(
        trainable=trainable,
        inner=inner,
        training=training,
        expected_zero=expected_zero,
        microbatch=choice,
        post=post,
    )


def _microbatch(
    plan: RunPlan,
    ctx: Any,
    loss: Any,
    params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    *,
    device: torch.device,
    randomness: str,
    post: PostStep | None,
) -> MicrobatchChoice:
    """The microbatch (records at once), printed with the plan's ``memory`` line and, with
    ``--compile``, its ``compile`` line."""
    choice = microbatch_for_run(
        plan,
        loss,
        params,
        device=device,
        world_size=ctx.world_size,
        randomness=randomness,
        post=post,
    )
    if ctx.is_main and choice.line is not None:
        print(f"memory    {choice.reason}", file=sys.stderr, flush=True)
    s = plan.settings
    if ctx.is_main and s.compile:
        print(compile_line(plan.engine, choice.microbatch, plan.max_batch_size), file=sys.stderr)
    return choice


def _start(r: _Run) -> None:
    """Write the settings of a new run and evaluate the start, or restore a checkpoint."""
    s = r.plan.settings
    if s.resume:
        # a checkpoint written before DPTraining (the same parts) loads too
        extra = r.training.load(r.checkpoint, model=None if s.shard else r.trainable)
        _check_resumed_settings(extra.get("settings", {}), s)
        check_resumed_data(extra.get("data_sha256"), r.data_sha256)
        r.start_step = r.training.steps
        r.rows = [dict(row) for row in extra.get("metrics", [])]
        r.initial_val = extra.get("initial_val_loss")
        if r.ctx.is_main:
            print(
                f"resume    after step {r.start_step} of {r.plan.steps}: ε = "
                f"{r.training.epsilon():.3f} spent so far at δ = {r.plan.delta:.3g} (the "
                "accountant's saved history; the remaining steps add to it)",
                file=sys.stderr,
                flush=True,
            )
    elif r.evaluates:
        r.initial_val = r.evaluate()  # every rank when sharded
        if r.ctx.is_main:
            # --out is created only now, just before the first step: an interrupt while the
            # model is built or the start evaluated leaves nothing behind
            r.plan.out.mkdir(parents=True, exist_ok=True)
            write_json(r.plan.out / SETTINGS_FILE, s.to_dict())


def _loop(r: _Run) -> float | None:
    """The steps from ``start_step`` to the planned end; returns the last validation loss.

    Ctrl-C at a step boundary (no batch drawn, no noise drawn, nothing stepped or accounted
    for the next step yet) checkpoints the completed steps; during a step it stops unsaved.
    """
    from opake.profiling import reset_peak_memory

    plan, s = r.plan, r.plan.settings
    warmup = s.warmup if s.warmup is not None else max(1, round(0.05 * plan.steps))
    eval_every = s.eval_every or max(1, plan.steps // 10)
    reset_peak_memory(r.device)
    batches = r.training.batches()
    bar = make_progress(
        plan.steps,
        initial=r.start_step,
        enabled=s.progress and r.ctx.is_main,
        desc="opake train" if not s.reproducible else "opake train [seeded, not private]",
    )
    val_loss: float | None = None
    peak_seen: float | None = None
    # the validation loss above the initial one for 3 evaluations in a row: say so, once
    watch = DivergenceWatch(r.initial_val, patience=3)
    at_boundary = True
    boundary = StepBoundary(enabled=not r.ctx.is_distributed)
    try:
        boundary.__enter__()
        for step in range(r.start_step, plan.steps):
            at_boundary = True
            boundary.check()
            lr = _lr_at(step, steps=plan.steps, peak=s.lr, warmup=warmup)
            at_boundary = False
            for group in r.inner.param_groups:
                group["lr"] = lr
            row = _step(r, batches, lr)
            done = row["step"]
            val_loss = None
            if r.evaluates and (done % eval_every == 0 or done == plan.steps):
                val_loss = row["val_loss"] = r.evaluate()  # every rank when sharded
                if r.ctx.is_main:
                    watch_divergence(watch, val_loss, done, plan)
            peak_seen = _max_none([peak_seen, row["peak_memory_gb"]])
            r.rows.append(row)
            bar.set_postfix_str(step_postfix(row, peak_seen), refresh=False)
            bar.update(1)
            if done % s.checkpoint_every == 0 and done < plan.steps:
                r.save()
            at_boundary = True
    except KeyboardInterrupt:
        bar.close()
        _interrupted(r, at_boundary)
        raise
    finally:
        boundary.__exit__(None, None, None)
    bar.close()
    return val_loss


def _step(r: _Run, batches: Iterator[list[int]], lr: float) -> dict[str, Any]:
    """One logical DP step on the next Poisson batch; its row of metrics (``val_loss`` None)."""
    import torch

    from opake.dpsgd.distributed import gather_metrics
    from opake.dpsgd.sampling import padding_mask
    from opake.profiling import step_perf

    plan = r.plan
    indices = next(batches)
    mask = None if plan.max_batch_size is None else padding_mask(indices).to(r.device)
    real = len(indices) if mask is None else int(mask.sum())
    with step_perf(r.device, batch_size=real) as perf:
        if r.post is not None:
            aux, losses = r.post.accumulate(r.training, indices, mask)
        else:
            index = torch.as_tensor(indices, dtype=torch.long).clamp_min(0)
            aux = r.training.accumulate(
                plan.train[index].to(r.device),
                example_mask=mask,
                records=indices if plan.units is not None else None,
            )
            losses = aux.loss_values
        perf.mark("clipped_grad")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OpakePrivacyWarning)
            r.training.finish_step()
        _reemit(caught, r.expected_zero, r.trainable)
        perf.mark("noise_and_update")
    eps = r.training.epsilon()
    if mask is not None:
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
    if r.ctx.is_distributed:
        agg = gather_metrics(figures).aggregate()
        figures = {k: agg[k]["max" if k in _MAX_FIGURES else "sum"] for k in figures}
    count = figures["count"]
    step_time = figures["step_time_sec"]
    return {
        "step": r.training.steps,
        "train_loss": figures["loss_sum"] / count if count else float("nan"),
        "val_loss": None,
        "epsilon": eps,
        "batch_size": int(count),
        "clipping_rate": figures["clipped"] / count if count else 0.0,
        "step_time_sec": step_time,
        "samples_per_second": count / step_time if step_time > 0 else None,
        "peak_memory_gb": result.memory_peak_gb and figures["memory_peak_gb"],
        "lr": lr,
    }


def _interrupted(r: _Run, at_boundary: bool) -> None:
    """Ctrl-C: checkpoint the completed steps at a boundary, and say how to continue."""
    completed = int(r.rows[-1]["step"]) if r.rows else r.start_step
    if completed == 0 and at_boundary and r.ctx.is_main:
        _interrupted_before_training(r.plan, created=r.created_out)
        return
    if at_boundary and not r.ctx.is_distributed:
        if completed > r.start_step:
            r.save()
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


def _interrupted_before_training(plan: RunPlan, *, created: bool) -> None:
    """Ctrl-C before the first step: say so, and leave no trace of a new run in ``--out``."""
    interrupted_before_training(
        plan.out, resume=plan.settings.resume, created=created, written=[SETTINGS_FILE]
    )


def _finish(r: _Run, val_loss: float, *, wall: float, trained: Any) -> dict[str, Any]:
    """Rank 0: save the model, write metrics.csv, the plots and summary.json."""
    from opake.profiling import get_memory_stats

    plan, s = r.plan, r.plan.settings
    saved = _save_model(plan, r.loaded, trained)
    mem = get_memory_stats(r.device)
    grad_fn = r.training.grad_fn
    summary = _summary(
        plan,
        rows=r.rows,
        val_loss=val_loss,
        initial_val=r.initial_val,
        peak_gb=_max_none(row["peak_memory_gb"] for row in r.rows),
        memory_process_level=mem.process_level,
        loaded=r.loaded,
        microbatch=r.microbatch,
        resumed_from=r.start_step if s.resume else None,
        wall=wall,
        saved=saved,
        accountant=r.training.accountant,
        patch_report=r.patch_report,
        world_size=r.ctx.world_size,
        device=r.device,
        engine=(getattr(grad_fn, "engine", None), getattr(grad_fn, "engine_reason", None)),
    )
    write_metrics(plan.out / "metrics.csv", r.rows)
    if s.plots:
        plots = plot_metrics(plan.out, r.rows, baseline=plan.baseline, delta=plan.delta)
        summary["plots"] = [p.name for p in plots]
    write_json(plan.out / "summary.json", summary)
    if r.microbatch.table:
        (plan.out / "microbatch_tuning.txt").write_text(r.microbatch.table + "\n", encoding="utf-8")
    return summary
