"""``opake train``: the command (argument parsing, the plan printout, the final report).

With no arguments it fine-tunes a small Llama-family model (``llama-small``, built from a config)
with DP-SGD on Python's own documentation (``pydoc_data.topics``), byte-tokenised, at ε = 8 and
δ = 1/N², and writes ``summary.json``, ``metrics.csv``, ``loss.png``, ``epsilon.png``, the model
and a checkpoint into ``opake-run/``. See ``docs/guide/train.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["register"]


def _print_plan(plan: Any) -> None:
    s = plan.settings
    counted = plan.units is not None or plan.post is not None  # units or records
    lines = [
        *_data_lines(plan),
        *_unit_lines(plan),
        (
            f"privacy   ε = {plan.planned_epsilon:.3g} at δ = {plan.delta:.3g} ({s.accountant}) "
            f"per {plan.unit_name} with σ = {plan.noise_multiplier:.4g}, C = {s.clip:g}, "
            f"q = {plan.sample_rate:.4g} (expected batch {s.batch_size}"
            f"{' ' + plan.unit_name + 's' if counted else ''}), {plan.steps} steps"
        ),
        _baseline_line(plan),
        (
            "random    secure: noise and batches from a fresh operating-system key (never stored)"
            if not s.reproducible
            else f"random    seeded (not private): noise and batches replayable from --seed "
            f"{s.seed} (--reproducible)"
        ),
    ]
    for line in lines:
        print(line, file=sys.stderr)
    for note in plan.notes:
        print(f"note      {note}", file=sys.stderr)


def _data_lines(plan: Any) -> list[str]:
    """The data, and for post-training records what was detected and the objective."""
    s, post = plan.settings, plan.post
    if post is None:
        return [
            (
                f"data      {plan.corpus.name}: {plan.corpus.num_chars:,} characters → "
                f"{plan.dataset_size:,} training blocks of {s.block_size} tokens, "
                f"{plan.val.shape[0]:,} validation blocks"
            )
        ]
    from opake.cli._records import KINDS

    chat = " through the model's chat template" if post.chat else ""
    data = (
        f"data      {plan.corpus.name}: {post.records:,} {KINDS[post.kind]} records{chat} → "
        f"{plan.dataset_size:,} training records, {plan.val.shape[0]:,} validation records, "
        f"{post.rows_per_record} row(s) of up to {plan.train.shape[-1]} tokens each"
    )
    return [data, f"objective {post.describe()}"]


def _baseline_line(plan: Any) -> str:
    """What the validation loss is compared with."""
    if plan.post is None:
        return f"baseline  unigram validation loss {plan.baseline:.4f} nats/token"
    if plan.post.objective == "sft":
        return (
            f"baseline  unigram validation loss {plan.baseline:.4f} nats/token (the completion "
            "tokens of the validation records)"
        )
    return (
        f"baseline  DPO validation loss of the starting model: ln 2 = {plan.baseline:.4f} (the "
        "policy is its own reference at the start)"
    )


def _unit_lines(plan: Any) -> list[str]:
    """``--privacy-unit``: the units, blocks per unit and the cap."""
    if plan.units is None:
        return []
    from opake.dpsgd.sampling import UnitPoissonSampler

    summary = UnitPoissonSampler(
        plan.units, plan.sample_rate, max_records_per_unit=plan.settings.max_records_per_unit
    ).summary()
    described = summary.describe(plan.unit_name).replace(" records", " blocks")
    line = (
        f"units     {described}; ε protects all blocks of one {plan.unit_name} together "
        "(user-level DP); blocks never mix units, validation holds out whole units"
    )
    return [line]


def _run(args: argparse.Namespace) -> int:
    from opake.cli._settings import settings_from_args
    from opake.cli._trainer import plan_run, run

    settings = settings_from_args(args)
    try:
        plan = plan_run(settings)
    except KeyboardInterrupt:
        print(
            "opake train: interrupted while planning the run; nothing was written", file=sys.stderr
        )
        return 130
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for all
        _print_plan(plan)
    try:
        summary = run(plan)
    except KeyboardInterrupt:  # reported where it was caught (before or during the steps)
        return 130
    if summary is None:  # another rank than 0: rank 0 reports
        return 0
    verdict = "below" if summary["val_loss"] < summary["unigram_baseline"] else "NOT below"
    print(
        f"done: {summary['steps']} steps, ε = {summary['epsilon']:.3f} at δ = "
        f"{summary['delta']:.3g} per {plan.unit_name}; validation loss "
        f"{summary['val_loss']:.4f} ({verdict} the {plan.baseline_name} "
        f"{summary['unigram_baseline']:.4f}); "
        f"{summary['samples_per_second']:.1f} samples/s; outputs in {plan.out}"
    )
    return 0


def register(sub: Any) -> None:
    """Add the ``train`` subcommand to the ``opake`` parser."""
    from opake.cli._settings import add_train_arguments

    p = sub.add_parser(
        "train",
        help="DP-SGD fine-tuning of a causal language model (runs with no arguments)",
        description=(
            "Differentially private fine-tuning (DP-SGD) of a causal language model. With no "
            "arguments: a small Llama built from a config, a byte tokenizer and Python's own "
            "documentation as corpus, at ε = 8, δ = 1/N²."
        ),
    )
    add_train_arguments(p)
    p.set_defaults(run=_run)
