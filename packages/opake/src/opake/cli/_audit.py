"""``opake audit``: ``opake train``'s pipeline with canaries, and claimed ε vs a measured bound.

The run is ``opake train``'s (same options, defaults, data, model, σ calibration, sampler,
clipping engine, DP optimizer and accountant, composed by one
:class:`~opake.dpsgd.training.DPTraining` as ``opake train`` composes it) with m canaries, each
included with probability ½ (see :mod:`opake.auditing`):

- ``--canaries gradient`` (default, white-box): canary i is dataset slot N + i, one example of
  an audit layer the model never reads; when the sampler draws an included canary, its
  gradient (a unit direction × 100·C) is clipped by the engine the run's own examples went
  through in that step (book-keeping on a full model) and joins the noisy sum. A quarter of the
  canaries are plain (``--canary-direction``), the others crafted against book-keeping's
  numerics (huge cancelling per-token terms, underflowing inputs, absorbed products: a true
  norm of 100·C whose Gram norm computes as 0). Each canary is scored by the noisy sums along
  its direction (over all steps, the likelihood ratio, and over the steps of a public replay of
  the sampler), and guessed over all canaries and kind by kind;
- ``--canaries input`` (black-box): included random-token blocks join the training data; each
  canary is scored by its loss reduction (initial model − trained model). With
  ``--privacy-unit FIELD`` (user-level DP) each input canary is a **unit** of
  ``--canary-records`` M blocks, included or left out as a whole, sampled and clipped as a unit,
  and scored by its blocks' mean loss reduction: the bound is on ε per unit
  (:mod:`opake.cli._audit_units`; gradient canaries, single examples, are refused with units).

The guesses become a lower bound on ε (Steinke, Nasr & Jagielski 2023), printed next to the
claimed ε with what the audit could show — the most it can prove (a perfect attack), what a
run that exactly meets the claim is expected to show (simulated audits of the run's σ, q and
T), and what would make it informative — and written to ``audit.json`` and ``audit.png`` in
``--out`` (default ``opake-audit``), which must not hold an earlier audit or a training run.
The audit run does not evaluate, checkpoint or save the model: ``opake train``'s ``--resume``,
``--checkpoint-every``, ``--eval-every`` and ``--max-val-blocks`` are not its options (hidden,
refused with the reason), and ``--offload-optimizer`` is refused with gradient canaries (they
read each step's noisy gradient, which the offloaded optimizer keeps elsewhere). The run itself
is :mod:`opake.cli._audit_run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from opake.cli._audit_run import REFUSED, run_audit
from opake.cli._audit_units import DEFAULT_CANARY_RECORDS, canary_records
from opake.core.errors import ConfigurationError

__all__ = ["CANARY_KINDS", "register", "run_audit"]

CANARY_KINDS = ("gradient", "input")
DIRECTIONS = ("dirac", "random")
#: what an audit writes into --out
OUTPUTS = ("audit.json", "audit.png")
#: --out when not given (opake train's is opake-run: an audit never writes into a run)
DEFAULT_OUT = "opake-audit"
#: the option that makes each piece of advice (opake.auditing.Advice.change)
ADVICE_OPTIONS = {
    "canaries": "--canary-count",
    "claim": "--target-epsilon",
    "steps": "--steps",
    "canary_kind": "--canaries",
}


class _Refused(argparse.Action):
    """An ``opake train`` option the audit does not honour: a usage error saying why."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> NoReturn:
        raise argparse.ArgumentError(self, REFUSED[self.option_strings[0]])


def _check_out(out: Path) -> None:
    """``--out``: a new directory, or one that holds neither an audit nor a training run."""
    from opake.cli._plan import CHECKPOINT_FILE

    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"--out {out}: exists and is not a directory")
    found = [name for name in OUTPUTS if (out / name).exists()]
    if found:
        raise ConfigurationError(
            f"--out {out} already holds an audit ({', '.join(found)}); an audit never replaces "
            f"another: choose another --out, or delete {out / found[0]} to replace it"
        )
    if (out / CHECKPOINT_FILE).exists():
        raise ConfigurationError(
            f"--out {out} holds an opake train run ({CHECKPOINT_FILE}); an audit trains a run of "
            "its own: choose another --out"
        )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    records = canary_records(args)  # first: gradient canaries are refused with --privacy-unit
    if args.canary_count < 2:
        raise ConfigurationError(f"--canary-count {args.canary_count}: expected an int >= 2")
    if not 0.5 <= args.confidence < 1.0:
        raise ConfigurationError(
            f"--confidence {args.confidence}: expected a probability in [0.5, 1)"
        )
    if args.canaries == "gradient" and args.offload_optimizer:
        raise ConfigurationError(
            "--offload-optimizer with gradient canaries: they are scored from each step's noisy "
            "gradient of the audit layer, which an offloaded optimizer does not leave on the "
            "parameters; drop --offload-optimizer, or use --canaries input"
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
        "records": records,  # M blocks per canary unit with --privacy-unit, else None
    }


def _print_plan(plan: Any, options: dict[str, Any]) -> None:
    """The data, the units (``--privacy-unit``), the audit's canaries and privacy, the notes."""
    from opake.cli._audit_units import unit_audit_line, unit_notes
    from opake.cli._train import _unit_lines

    s = plan.settings
    kinds = ""
    if options["kind"] == "gradient":
        from opake.auditing import CRAFTED_KINDS

        kinds = f" ({options['direction']}, {', '.join(CRAFTED_KINDS)})"
    lines = [
        (
            f"data      {plan.corpus.name}: {plan.corpus.num_chars:,} characters → "
            f"{plan.dataset_size:,} training blocks of {s.block_size} tokens"
        ),
        *_unit_lines(plan),
    ]
    notes = list(plan.notes)
    if plan.units is not None:
        lines.append(unit_audit_line(plan, options["count"], options["records"]))
        notes += unit_notes(plan, options["records"])
    else:
        lines.append(
            f"audit     {options['count']} {options['kind']} canaries{kinds}, each included with "
            f"probability ½, on {plan.dataset_size:,} training blocks; σ = "
            f"{plan.noise_multiplier:.4g}, C = {s.clip:g}, q = {plan.sample_rate:.4g}, "
            f"{plan.steps} steps, planned ε = {plan.planned_epsilon:.3g} at δ = {plan.delta:.3g}"
        )
    for line in lines:
        print(line, file=sys.stderr)
    for note in notes:
        print(f"note      {note}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from opake.cli._blocks import data_kind
    from opake.cli._settings import settings_from_args
    from opake.cli._trainer import plan_run

    options = _options(args)
    settings = settings_from_args(args)
    _check_out(Path(settings.out))
    if data_kind(settings) != "text":
        raise ConfigurationError(f"--data {settings.data}: {REFUSED['--objective']}")
    plan = plan_run(settings)
    _print_plan(plan, options)
    try:
        result = run_audit(plan, **options)
    except KeyboardInterrupt:
        return 130
    _check_out(plan.out)  # still free: another audit may have written there meanwhile
    plan.out.mkdir(parents=True, exist_ok=True)
    result.write_json(plan.out / "audit.json")
    if settings.plots:
        result.plot(plan.out / "audit.png")
    print(f"done: {result.summary()}; outputs in {plan.out}")
    if plan.units is not None:
        print(
            f"  unit: ε per {plan.unit_name}; the {options['count']} canaries are units of "
            f"{options['records']} blocks each, included or left out as a whole"
        )
    for line in result.explain(options=ADVICE_OPTIONS):
        print(f"  {line}")
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
            "the claimed ε with what the audit could show (the most it can prove, what a run "
            "that meets the claim is expected to show) and what would make it informative; "
            "written to audit.json and audit.png in a new --out. The audit does not evaluate, "
            "checkpoint or save the model."
        ),
        conflict_handler="resolve",  # opake train's options the audit refuses are replaced
    )
    add_train_arguments(p)
    for option in REFUSED:  # replaces opake train's: hidden, and a usage error when given
        p.add_argument(
            option, nargs="?", action=_Refused, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    g = p.add_argument_group("audit")
    g.add_argument(
        "--canaries",
        choices=CANARY_KINDS,
        default="gradient",
        help="gradient: white-box canaries, examples of an audit layer clipped by the run's "
        "engine, plain and crafted against book-keeping's numerics (default); input: "
        "random-token blocks inserted into the data (black-box, loss reduction)",
    )
    g.add_argument(
        "--canary-count",
        type=int,
        default=1000,
        help="m, canaries (default 1000; each tenfold adds about one unit of ε to the most "
        "the audit can prove)",
    )
    g.add_argument(
        "--canary-direction",
        choices=DIRECTIONS,
        default="dirac",
        help="the plain gradient canaries (a quarter of them): one coordinate each (dirac, "
        "default) or random rank-one directions",
    )
    g.add_argument(
        "--canary-records",
        type=int,
        default=None,
        metavar="M",
        help="with --privacy-unit and --canaries input: the random-token blocks of one canary "
        f"unit, included or left out as a whole (default {DEFAULT_CANARY_RECORDS})",
    )
    g.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence of the lower bound (default 0.95)",
    )
    p.set_defaults(run=_run, out=DEFAULT_OUT)
