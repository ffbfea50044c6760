"""``opake audit``'s run: ``opake train``'s DP step with canaries, scored and bounded.

:func:`run_audit` builds the model, draws which canaries are in, composes the DP step with one
:class:`~opake.dpsgd.training.DPTraining` as ``opake train`` does (the canary slots in its
sampler's dataset; gradient canaries' clipped sum accumulated next to the data's, through the
engine the data went through; input canaries as extra training blocks), trains the planned
steps, scores the canaries and returns the :class:`~opake.auditing.AuditResult` — with what the
audit could show for the run's σ, q and T. With ``--privacy-unit`` the input canaries are units
of several blocks, sampled and clipped as units (:mod:`opake.cli._audit_units`). The command
(options, ``--out``, the printout) is :mod:`opake.cli._audit`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OpakePrivacyWarning

if TYPE_CHECKING:
    import numpy as np
    import torch

    from opake.auditing import AuditResult
    from opake.cli._plan import RunPlan

__all__ = ["REFUSED", "run_audit"]

_EVAL_BATCH = 64
#: why an audit refuses SFT and DPO records
_TEXT_ONLY = (
    "an audit measures language-model training on text blocks; SFT and DPO records are not "
    "audited yet: audit a text corpus (--data FILE, or a JSONL file of text records)"
)
#: opake train's options an audit does not honour, and why: refused, and not in --help
REFUSED = {
    "--resume": (
        "an audit is one uninterrupted run and saves no checkpoint; start it again without "
        "--resume (into a new --out)"
    ),
    "--checkpoint-every": "an audit saves no checkpoint; drop --checkpoint-every",
    "--eval-every": "an audit does not evaluate on the validation split; drop --eval-every",
    "--max-val-blocks": "an audit does not evaluate on the validation split; drop --max-val-blocks",
    "--compile": "an audit runs the eager DP step (canaries join it uncompiled); drop --compile",
    "--objective": _TEXT_ONLY,
    "--dpo-beta": _TEXT_ONLY,
}


@dataclass
class _Canaried:
    """The training data with the canaries: the included input canaries appended to it (with
    ``--privacy-unit``, as whole units: ``units`` names every row's unit, ``records`` blocks per
    canary), or the gradient canaries' run (the sampler draws dataset slots ``N + i`` for them)."""

    included: Any
    data: torch.Tensor
    total: int
    run: Any = None
    examples: Any = None
    before: Any = None
    labels: Any = None
    engines: dict[str, int] = field(default_factory=dict)  # the data's engine, step by step
    units: list[str] | None = None
    records: int = 1

    @property
    def extra_params(self) -> dict[str, Any]:
        return {} if self.run is None else dict(self.run.params)


def _canary_losses(model: Any, examples: Any, device: Any) -> torch.Tensor:
    """Per-example mean next-token loss of each row (fp32, CPU)."""
    import torch

    from opake.dpsgd.bookkeeping import causal_lm_losses

    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for chunk in examples.split(_EVAL_BATCH):
            x = chunk.to(device)
            logits = model(input_ids=x, use_cache=False).logits
            out.append(causal_lm_losses(logits.float(), x).cpu())
    model.train(was_training)
    return torch.cat(out).double()


def _with_canaries(
    plan: RunPlan, model: Any, options: dict[str, Any], secret: int | None
) -> _Canaried:
    """Draw which canaries are in (probability ½ each) and put them into the run."""
    import torch

    from opake.auditing import GradientCanaries, draw_inclusion, random_token_canaries
    from opake.cli._audit_units import unit_canary_data
    from opake.cli._blocks import encoder

    s = plan.settings
    included = draw_inclusion(options["count"], seed=None if secret is None else secret + 1)
    data = plan.train
    if options["kind"] == "input":
        _, _, vocab = encoder(plan.tokenizer)
        # blocks per canary: a unit's M with --privacy-unit, else one
        records = (options.get("records") or 1) if plan.units is not None else 1
        canaries = random_token_canaries(
            options["count"] * records, length=s.block_size, vocab_size=vocab, seed=secret
        )
        before = _canary_losses(model, canaries.examples, plan.device)
        units = None
        if plan.units is None:
            data = torch.cat([data, canaries.included_examples(included)])
        else:  # whole canary units, under keys of their own, after the data's units
            data, units = unit_canary_data(plan, canaries.examples, included, records)
        return _Canaried(
            included,
            data,
            int(data.shape[0]),
            examples=canaries.examples,
            before=before,
            units=units,
            records=records,
        )
    spec = GradientCanaries(options["count"], kind=options["direction"])
    run = spec.run(
        included,
        dataset_size=int(data.shape[0]),
        clipping_norm=s.clip,
        device=plan.device,
        engine=plan.engine,
    )
    return _Canaried(included, data, run.total_size, run=run, labels=spec.labels)


def _max_batch(plan: RunPlan, total: int) -> int | None:
    """``B_max`` of fixed-shape sampling over the data and canary slots (as ``opake train``
    chooses it for the data alone); ``None`` for Poisson sampling."""
    from opake import accounting

    if plan.max_batch_size is None:
        return None
    return accounting.fixed_shape_slots(
        dataset_size=total,
        sample_rate=plan.sample_rate,
        steps=plan.steps,
        delta=plan.delta,
        target_epsilon=plan.settings.target_epsilon,
    )


def _dp_training(
    plan: RunPlan, model: Any, patch_report: Any, canaried: _Canaried, secret: int | None
) -> tuple[Any, torch.optim.Optimizer, frozenset[str]]:
    """``opake train``'s DP step (one :class:`~opake.dpsgd.training.DPTraining`) over the data
    and canary slots: the model's per-example loss, clipping engine, microbatch, optimizer,
    accountant and sampler. The audit parameter of gradient canaries is in the DP optimizer
    (noised and stepped with the rest) but not in the gradient function: its clipped sum is
    accumulated into ``training.optimizer`` next to the data's."""
    from opake.auditing import CANARY_PARAMETER
    from opake.cli._memory import microbatch_for_run
    from opake.cli._setup import (
        _autocast_factory,
        _zero_partner_lora_a,
        forward_options,
        inner_optimizer,
        per_example_loss,
    )
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    s = plan.settings
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    autocast = _autocast_factory(s.precision, plan.device)
    loss = per_example_loss(plan, fmodel, forward_options(patch_report), autocast)
    randomness = "different" if plan.dropout else "error"
    # with --privacy-unit, a step is sized for the data's and the canaries' units
    sized = plan if canaried.units is None else dataclasses.replace(plan, units=canaried.units)
    choice = microbatch_for_run(
        sized, loss, (trainable, frozen), device=plan.device, world_size=1, randomness=randomness
    )
    if choice.line is not None:  # the memory-aware default decided: say what and why
        print(f"memory    {choice.reason}", file=sys.stderr, flush=True)
    microbatch = choice.microbatch
    inner = inner_optimizer(plan, model)
    extra = canaried.extra_params
    if extra:  # the audit parameter: same optimizer settings, stepped with the model
        inner.add_param_group({"params": list(extra.values())})
    max_batch = _max_batch(plan, canaried.total)
    training = DPTraining(
        loss,
        inner,
        trainable,
        args=(frozen,),
        module={**trainable, **extra},  # every tensor the DP optimizer noises and steps
        dataset_size=canaried.total,
        microbatch_size=microbatch,
        randomness=randomness,
        sampler="poisson" if max_batch is None else "fixed",
        max_batch_size=max_batch,
        seed=secret,
        # --privacy-unit: the data's and the included canaries' units, each clipped as one
        privacy_units=canaried.units,
        max_records_per_unit=None if canaried.units is None else s.max_records_per_unit,
        **plan.training_options(),
    )
    expected_zero = _zero_partner_lora_a(trainable) | ({CANARY_PARAMETER} if extra else set())
    return training, inner, frozenset(expected_zero)


def _replay(total: int, plan: RunPlan, max_batch: int | None) -> list[list[int]]:
    """The batches of the run's sampler class rebuilt with the public replay seed."""
    from opake.auditing import REPLAY_SEED
    from opake.dpsgd import sampling

    if max_batch is None:
        sampler: Any = sampling.PoissonSampler(total, plan.sample_rate, seed=REPLAY_SEED)
    else:
        sampler = sampling.FixedShapePoissonSampler(
            total, plan.sample_rate, max_batch, seed=REPLAY_SEED
        )
    out: list[list[int]] = []
    while len(out) < plan.steps:
        out.extend([int(i) for i in batch] for batch in sampler)
    return out[: plan.steps]


def _train(
    plan: RunPlan,
    training: Any,
    inner: torch.optim.Optimizer,
    canaried: _Canaried,
    expected_zero: frozenset[str],
) -> None:
    """``plan.steps`` logical DP steps with ``opake train``'s learning-rate schedule; the drawn
    included gradient canaries' clipped sum — by the engine the data went through in that
    step — joins each step's sum before the noise."""
    import torch

    from opake.cli._progress import make_progress
    from opake.cli._setup import _reemit
    from opake.cli._trainer import _lr_at

    s = plan.settings
    run, data = canaried.run, canaried.data
    n_data = int(data.shape[0])
    names = tuple(training.optimizer.param_names)
    warmup = s.warmup if s.warmup is not None else max(1, round(0.05 * plan.steps))
    bar = make_progress(plan.steps, desc="opake audit", enabled=s.progress)
    batches = training.batches()
    for step in range(plan.steps):
        for group in inner.param_groups:
            group["lr"] = _lr_at(step, steps=plan.steps, peak=s.lr, warmup=warmup)
        indices, ids = [int(i) for i in next(batches)], []
        if run is not None:
            indices, ids = run.split(indices)
        # the data's examples (fixed-shape padding and canary slots are not data)
        real = torch.as_tensor([i for i in indices if 0 <= i < n_data], dtype=torch.long)
        # with units, every index is a record (Poisson only) and names its unit for the step
        records = indices if canaried.units is not None else None
        training.accumulate(data[real].to(plan.device), records=records)
        engine = str(training.grad_fn.engine)
        canaried.engines[engine] = canaried.engines.get(engine, 0) + 1
        if run is not None:  # always, even with no canary drawn: a zero sum with sensitivity C
            training.optimizer.accumulate(run.clipped_sum(ids, engine=engine))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OpakePrivacyWarning)
            training.finish_step()
        # expected on the first step: no gradient yet for LoRA A matrices whose B is zero, nor
        # for the audit parameter when no included canary was drawn
        _reemit(caught, expected_zero, names)
        if run is not None:
            run.observe(expected_batch_size=training.expected_batch_size)
        bar.set_postfix_str(f"ε {training.epsilon():.2f}", refresh=False)
        bar.update(1)
    bar.close()


def _scores(
    plan: RunPlan, model: Any, canaried: _Canaried
) -> dict[str, np.ndarray] | dict[str, torch.Tensor]:
    """Gradient canaries: the noisy sums along each direction (every attack); input canaries:
    the loss reduction from the initial model."""
    if canaried.run is not None:
        scores: dict[str, np.ndarray] = canaried.run.scores(  # a GradientCanaries run's
            _replay(canaried.total, plan, _max_batch(plan, canaried.total)),
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
        )
        return scores
    after = _canary_losses(model, canaried.examples, plan.device)
    reduction = canaried.before - after
    if canaried.units is not None:  # a canary unit: the mean over its blocks
        from opake.cli._audit_units import unit_scores

        reduction = unit_scores(reduction, records=canaried.records)
    return {"loss_reduction": reduction}


def _recorded_settings(plan: RunPlan) -> dict[str, Any]:
    """The audit's settings for ``audit.json``: the options it takes (not those it refuses),
    the corpus named as ``--data`` takes it (the default one included)."""
    s = plan.settings
    settings = {
        name: value
        for name, value in s.to_dict().items()
        if "--" + name.replace("_", "-") not in REFUSED
    }
    settings["data"] = s.data if s.data is not None else plan.corpus.name
    return settings


def _engine_text(engines: dict[str, int]) -> str:
    """``"bookkeeping"``, or each engine with its step count when the run used several."""
    if len(engines) == 1:
        return next(iter(engines))
    return ", ".join(f"{name} ({n} steps)" for name, n in sorted(engines.items()))


def _per_unit(plan: RunPlan, result: AuditResult, canaried: _Canaried) -> AuditResult:
    """A user-level audit's result: its advice for canary units, and the unit in audit.json."""
    from opake.cli._audit_units import unit_report, unit_result

    result = unit_result(result)
    result.extra.update(unit_report(plan, canaried.records, int(canaried.included.sum())))
    return result


def run_audit(
    plan: RunPlan,
    *,
    kind: str = "gradient",
    count: int = 1000,
    direction: str = "dirac",
    confidence: float = 0.95,
    records: int | None = None,
) -> AuditResult:
    """Train as ``plan`` says, with ``count`` canaries of ``kind``; return the ``AuditResult``.

    With ``plan.units`` (``--privacy-unit``) the canaries are input canaries of ``records``
    blocks each, inserted, sampled and clipped as units; the statistics count canary units."""
    import torch

    from opake.auditing import SubsampledGaussian, one_run_audit
    from opake.cli._checks import disable_dropout
    from opake.cli._setup import _build_model

    s = plan.settings
    if plan.units is not None and kind != "input":
        raise ConfigurationError(
            f"kind={kind!r} with privacy units: a gradient canary is one example, not a unit of "
            "several records; audit a user-level run with input canaries (kind='input')"
        )
    started = time.perf_counter()
    secret = s.seed if s.reproducible else None  # secure by default: OS entropy, never stored
    torch.manual_seed(s.seed)
    _, model, patch_report = _build_model(plan, plan.device)
    if not s.dropout:
        disable_dropout(model)
    options = {"kind": kind, "count": count, "direction": direction, "records": records}
    canaried = _with_canaries(plan, model, options, secret)
    training, inner, expected_zero = _dp_training(plan, model, patch_report, canaried, secret)
    _train(plan, training, inner, canaried, expected_zero)
    run = canaried.run
    result = one_run_audit(
        _scores(plan, model, canaried),
        canaried.included,
        claimed_epsilon=training.epsilon(),
        delta=plan.delta,
        confidence=confidence,
        kind=kind,
        groups=canaried.labels,
        engine=run.engine_used if run is not None else _engine_text(canaried.engines),
        mechanism=SubsampledGaussian(plan.noise_multiplier, plan.sample_rate, plan.steps),
    )
    if canaried.units is not None:
        result = _per_unit(plan, result, canaried)
    engines = {"data": dict(canaried.engines)}
    if run is not None:
        engines["canaries"] = dict(run.engines)
    result.extra.update(
        {
            "engine_steps": engines,
            "planned_epsilon": plan.planned_epsilon,
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "steps": plan.steps,
            "dataset_size": plan.dataset_size,
            "canary_direction": direction if kind == "gradient" else None,
            "canaries_included": int(canaried.included.sum()),
            "randomness": plan.randomness,
            "wall_time_sec": time.perf_counter() - started,
            "cpu_count": os.cpu_count(),
            "data": {
                "corpus": plan.corpus.name,
                "characters": plan.corpus.num_chars,
                "training_blocks": plan.dataset_size,
                "block_size": s.block_size,
            },
            # the corpus used, named as --data takes it (the default corpus included)
            "settings": _recorded_settings(plan),
            "lower_bound_is_not": (
                "a measurement of the true ε: it is what this audit could prove; a bound at or "
                "below the claim is no proof of privacy"
            ),
        }
    )
    return result
