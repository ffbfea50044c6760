"""``opake audit``: ``opake train``'s pipeline with canaries, and claimed ε vs a measured bound.

The run is ``opake train``'s (same options, defaults, data, model, σ calibration, sampler,
clipping engine, DP optimizer and accountant) with m canaries, each included with probability
½ (see :mod:`opake.auditing`):

- ``--canaries gradient`` (default, white-box): canary i is dataset slot N + i; when the
  sampler draws an included canary, its gradient (a unit direction × 100·C) goes through
  ``clipped_grad`` and into the noisy sum; each canary is scored by the noisy sums along its
  direction (over all steps, and over the steps of a public replay of the sampler);
- ``--canaries input`` (black-box): included random-token blocks join the training data; each
  canary is scored by its loss reduction (initial model − trained model).

The guesses become a lower bound on ε (Steinke, Nasr & Jagielski 2023), printed next to the
claimed ε and written to ``audit.json`` and ``audit.png`` in ``--out``. The audit run does not
evaluate, checkpoint or save the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

from opake.core.errors import ConfigurationError, OpakePrivacyWarning

__all__ = ["CANARY_KINDS", "register", "run_audit"]

CANARY_KINDS = ("gradient", "input")
DIRECTIONS = ("dirac", "random")
_EVAL_BATCH = 64


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if args.resume:
        raise ConfigurationError(
            "--resume: an audit is one uninterrupted run; start it again without --resume"
        )
    if args.canary_count < 2:
        raise ConfigurationError(f"--canary-count {args.canary_count}: expected an int >= 2")
    if not 0.5 <= args.confidence < 1.0:
        raise ConfigurationError(
            f"--confidence {args.confidence}: expected a probability in [0.5, 1)"
        )
    if args.canaries == "input" and args.canary_direction != "dirac":
        raise ConfigurationError(
            "--canary-direction applies to gradient canaries; input canaries are random-token "
            "blocks: drop --canary-direction or use --canaries gradient"
        )
    return {
        "kind": args.canaries,
        "count": args.canary_count,
        "direction": args.canary_direction,
        "confidence": args.confidence,
    }


def _run(args: argparse.Namespace) -> int:
    from opake.cli._settings import settings_from_args
    from opake.cli._trainer import plan_run

    options = _options(args)
    settings = settings_from_args(args)
    plan = plan_run(settings)
    s = plan.settings
    print(
        f"audit     {options['count']} {options['kind']} canaries"
        f"{' (' + options['direction'] + ')' if options['kind'] == 'gradient' else ''}, each "
        f"included with probability ½, on {plan.dataset_size:,} training blocks; σ = "
        f"{plan.noise_multiplier:.4g}, C = {s.clip:g}, q = {plan.sample_rate:.4g}, "
        f"{plan.steps} steps, planned ε = {plan.planned_epsilon:.3g} at δ = {plan.delta:.3g}",
        file=sys.stderr,
    )
    try:
        result = run_audit(plan, **options)
    except KeyboardInterrupt:
        return 130
    plan.out.mkdir(parents=True, exist_ok=True)
    result.write_json(plan.out / "audit.json")
    if s.plots:
        result.plot(plan.out / "audit.png")
    print(f"done: {result.summary()}; outputs in {plan.out}")
    return 0


def register(sub: Any) -> None:
    """Add the ``audit`` subcommand to the ``opake`` parser."""
    from opake.cli._settings import add_train_arguments

    p = sub.add_parser(
        "audit",
        help="measure a lower bound on ε of an opake train run with canaries (runs with no "
        "arguments)",
        description=(
            "Empirical privacy audit in one training run: opake train's pipeline (same options "
            "and defaults) with canaries, each included with probability 1/2; the correct "
            "guesses give a lower bound on ε (Steinke, Nasr & Jagielski 2023), printed next to "
            "the claimed ε and written to audit.json and audit.png in --out."
        ),
    )
    add_train_arguments(p)
    g = p.add_argument_group("audit")
    g.add_argument(
        "--canaries",
        choices=CANARY_KINDS,
        default="gradient",
        help="gradient: white-box directions injected as examples' gradients (default); "
        "input: random-token blocks inserted into the data (black-box, loss reduction)",
    )
    g.add_argument("--canary-count", type=int, default=1000, help="m, canaries (default 1000)")
    g.add_argument(
        "--canary-direction",
        choices=DIRECTIONS,
        default="dirac",
        help="gradient canaries: one coordinate each (dirac, default) or random unit vectors",
    )
    g.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence of the lower bound (default 0.95)",
    )
    p.set_defaults(run=_run)


def _canary_losses(model: Any, examples: Any, device: Any) -> Any:
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


def _make_sampler(total: int, plan: Any, seed: int | None) -> tuple[Any, int | None]:
    from opake import accounting
    from opake.dpsgd import sampling

    if plan.settings.sampler != "fixed":
        return sampling.PoissonSampler(total, plan.sample_rate, seed=seed), None
    max_batch = accounting.max_batch_size_for(
        dataset_size=total,
        sample_rate=plan.sample_rate,
        steps=plan.steps,
        truncation_budget=plan.delta / 1000,
    )
    max_batch = min(max_batch, total)
    sampler = sampling.FixedShapePoissonSampler(total, plan.sample_rate, max_batch, seed=seed)
    return sampler, max_batch


def _replay(total: int, plan: Any, max_batch: int | None) -> list[list[int]]:
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


def _grad_fn(
    plan: Any, fmodel: Any, trainable: Any, frozen: Any, device: Any, *, loss_only: bool
) -> tuple[Any, Any]:
    """The data's clipped-gradient function, built as ``opake train`` builds it (the patched
    loss-only forward where the model family's kernels provide it)."""
    import torch

    from opake.cli._trainer import _autocast_factory, _tune_microbatch
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import autocast_loss

    s = plan.settings
    autocast = _autocast_factory(s.precision, device)

    extra = {"loss_only": True} if loss_only else {}

    def loss_fn(trainable: Any, frozen: Any, x: torch.Tensor) -> torch.Tensor:
        ids = x.unsqueeze(0)
        params = (trainable, frozen)
        return fmodel(params, input_ids=ids, labels=ids, use_cache=False, **extra).loss

    def batch_losses(trainable: Any, frozen: Any, x: torch.Tensor) -> torch.Tensor:
        with autocast():
            params = (trainable, frozen)
            if loss_only:
                out = fmodel(
                    params, input_ids=x, labels=x, per_example_loss=True, use_cache=False, **extra
                )
                return out.loss.float()  # type: ignore[no-any-return]
            out = fmodel(params, input_ids=x, use_cache=False)
            return causal_lm_losses(out.logits, x)

    per_example: Any = loss_fn
    if plan.engine == "vmap":
        if s.precision != "fp32":
            dtype = torch.bfloat16 if s.precision == "bf16" else torch.float16
            per_example = autocast_loss(loss_fn, dtype, argnums=0)
    else:
        per_example = BatchedLoss(batch_losses, fmodel)

    def make(microbatch: int | None) -> Any:
        return clipped_grad(
            per_example,
            argnums=0,
            clipping_norm=s.clip,
            batch_argnums=2,
            microbatch_size=microbatch,
            method=plan.engine,
        )

    if s.microbatch == "auto":
        microbatch, _ = _tune_microbatch(make, (trainable, frozen), plan, device, 1)
        return make(microbatch)
    return make(s.microbatch if isinstance(s.microbatch, int) else None)


def _optimizer(s: Any, params: list[Any]) -> Any:
    import torch

    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=0.9, weight_decay=s.weight_decay)
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)


def run_audit(
    plan: Any,
    *,
    kind: str = "gradient",
    count: int = 1000,
    direction: str = "dirac",
    confidence: float = 0.95,
) -> Any:
    """Train as ``plan`` says, with ``count`` canaries of ``kind``; return the ``AuditResult``."""
    import torch

    from opake import accounting
    from opake.auditing import (
        CANARY_PARAMETER,
        GradientCanaries,
        draw_inclusion,
        one_run_audit,
        random_token_canaries,
    )
    from opake.cli._progress import make_progress
    from opake.cli._trainer import _build_model, _encode, _lr_at, _reemit, _zero_partner_lora_a
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional

    s = plan.settings
    started = time.perf_counter()
    reproducible = bool(getattr(s, "reproducible", False))
    secret = s.seed if reproducible else None  # secure by default: OS entropy, never stored
    device = plan.device
    torch.manual_seed(s.seed)
    _, model, patch_report = _build_model(plan, device)
    loss_only = patch_report is not None and "linear_cross_entropy" in patch_report.kernels
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    included = draw_inclusion(count, seed=None if secret is None else secret + 1)
    data = plan.train
    run = None
    before = None
    if kind == "input":
        _, _, vocab = _encode(plan.tokenizer)
        canaries: Any = random_token_canaries(
            count, length=s.block_size, vocab_size=vocab, seed=None if secret is None else secret
        )
        before = _canary_losses(model, canaries.examples, device)
        data = torch.cat([data, canaries.included_examples(included)])
        total = int(data.shape[0])
    else:
        canaries = GradientCanaries(count, kind=direction)
        run = canaries.run(
            included, dataset_size=int(data.shape[0]), clipping_norm=s.clip, device=device
        )
        total = run.total_size
    grad_fn, clip_state = _grad_fn(plan, fmodel, trainable, frozen, device, loss_only=loss_only)
    sampler, max_batch = _make_sampler(total, plan, secret)
    params = {**trainable, **(run.params if run is not None else {})}
    expected_zero = _zero_partner_lora_a(trainable) | {CANARY_PARAMETER}
    inner = _optimizer(s, list(params.values()))
    accountant = accounting.make_accountant(s.accountant, **plan.accountant_options)
    dp_opt = DPOptimizer(
        inner,
        params,
        noise_multiplier=plan.noise_multiplier,
        sampler=sampler,
        accountant=accountant,
        delta=plan.delta,
        seed=secret,
    )
    warmup = s.warmup if s.warmup is not None else max(1, round(0.05 * plan.steps))
    bar = make_progress(plan.steps, desc="opake audit", enabled=s.progress)
    stream = iter(())
    n_data = int(data.shape[0])
    for step in range(plan.steps):
        for group in inner.param_groups:
            group["lr"] = _lr_at(step, steps=plan.steps, peak=s.lr, warmup=warmup)
        batch = next(stream, None)
        if batch is None:
            stream = iter(sampler)
            batch = next(stream)
        indices = [int(i) for i in batch]
        ids: list[int] = []
        if run is not None:
            indices, ids = run.split(indices)
        real = torch.as_tensor([i for i in indices if 0 <= i < n_data], dtype=torch.long)
        grads, clip_state = grad_fn(trainable, frozen, data[real].to(device), state=clip_state)
        dp_opt.accumulate(grads)
        if run is not None:
            dp_opt.accumulate(run.clipped_sum(ids))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OpakePrivacyWarning)
            report = dp_opt.step()
        # expected on the first step: no gradient yet for LoRA A matrices whose B is zero, nor
        # for the audit parameter when no included canary was drawn
        _reemit(caught, expected_zero, params)
        if run is not None:
            run.observe(expected_batch_size=dp_opt.expected_batch_size)
        bar.set_postfix_str(f"ε {report.epsilon:.2f}", refresh=False)
        bar.update(1)
    bar.close()
    if run is not None:
        scores: Any = run.scores(
            _replay(total, plan, max_batch),
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
        )
    else:
        assert before is not None
        scores = {"loss_reduction": (before - _canary_losses(model, canaries.examples, device))}
    claimed = float(accountant.get_epsilon(plan.delta))
    result = one_run_audit(
        scores,
        included,
        claimed_epsilon=claimed,
        delta=plan.delta,
        confidence=confidence,
        kind=kind,
    )
    result.extra.update(
        {
            "planned_epsilon": plan.planned_epsilon,
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "steps": plan.steps,
            "dataset_size": plan.dataset_size,
            "canary_direction": direction if kind == "gradient" else None,
            "canaries_included": int(included.sum()),
            "randomness": "seeded (not private)" if reproducible else "secure",
            "wall_time_sec": time.perf_counter() - started,
            "cpu_count": os.cpu_count(),
            "settings": s.to_dict(),
            "lower_bound_is_not": (
                "a measurement of the true ε: it is what this audit could prove; a bound at or "
                "below the claim is no proof of privacy"
            ),
        }
    )
    return result
