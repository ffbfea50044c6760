"""``opake audit --privacy-unit FIELD``: canaries that are units of several records.

A user-level run protects one unit (a user, a patient, an author) with all its records; its
audit inserts canaries that are **units**: canary i is ``--canary-records`` M random-token
blocks under a unit key of its own (``audit-canary:i``; the data's keys are ``str:…`` or
``int:…``, :func:`opake.cli._data.load_corpus`, so none can collide), included with
probability ½ as a whole — all M blocks, or none. The run is ``opake train --privacy-unit``'s:
one :class:`~opake.dpsgd.training.DPTraining` with ``privacy_units`` (the data's units, then
the included canaries'), ``records=`` at every step, q and σ of the plan (the canary units add
units to the sampled population, not privacy cost). A canary unit's score is the mean loss
reduction over its M blocks, and the one-run statistics count canary units: the bound is on ε
per unit. With ``--max-records-per-unit K < M`` canary units are capped like any unit (each step
a drawn canary brings a random K of its M blocks), and the plan says so.

Gradient canaries are single examples of an audit layer, clipped on their own, not units of
several records: with ``--privacy-unit`` they are refused (use ``--canaries input``).

>>> canary_unit_keys(2, ["str:ann", "int:7"])
['audit-canary:0', 'audit-canary:1']
>>> unit_scores(__import__("torch").tensor([1.0, 3.0, 0.0, 2.0]), records=2).tolist()
[2.0, 1.0]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.auditing import AuditResult
    from opake.cli._plan import RunPlan

__all__ = [
    "CANARY_UNIT_PREFIX",
    "DEFAULT_CANARY_RECORDS",
    "canary_records",
    "canary_unit_keys",
    "unit_audit_line",
    "unit_canary_data",
    "unit_notes",
    "unit_report",
    "unit_result",
    "unit_scores",
]

#: the unit key of canary i is this prefix and i; the data's keys start with str: or int:
CANARY_UNIT_PREFIX = "audit-canary:"
#: records (blocks) of one canary unit when --canary-records is not given
DEFAULT_CANARY_RECORDS = 4


def canary_records(args: argparse.Namespace) -> int | None:
    """M, the records of one canary unit (``None`` for an example-level audit), checked
    against ``--privacy-unit`` and ``--canaries``."""
    given: int | None = args.canary_records
    if args.privacy_unit is None:
        if given is not None:
            raise ConfigurationError(
                f"--canary-records {given} without --privacy-unit: canaries are units of several "
                "records only in a user-level audit; name the unit's JSONL field with "
                "--privacy-unit FIELD, or drop --canary-records (each canary is then one block)"
            )
        return None
    if args.canaries == "gradient":
        raise ConfigurationError(
            f"--privacy-unit {args.privacy_unit} with gradient canaries (the default): a gradient "
            "canary is one example of an audit layer, clipped on its own, not a unit of several "
            "records, so it cannot audit the per-unit guarantee; pass --canaries input (each "
            "canary a unit of --canary-records random-token blocks), or audit without "
            "--privacy-unit"
        )
    records = DEFAULT_CANARY_RECORDS if given is None else given
    if isinstance(records, bool) or not isinstance(records, int) or records < 1:
        raise ConfigurationError(
            f"--canary-records {records}: expected an int >= 1 (the blocks of one canary unit)"
        )
    return records


def canary_unit_keys(count: int, data_units: Sequence[str]) -> list[str]:
    """The unit keys of ``count`` canaries, none of them a unit of the data."""
    keys = [f"{CANARY_UNIT_PREFIX}{i}" for i in range(count)]
    clash = set(keys) & set(data_units)
    if clash:  # the data's keys are typed (str:…, int:…): only a change there can cause this
        raise ConfigurationError(
            f"the canary unit key {sorted(clash)[0]!r} is also a unit of the data: the canaries "
            "need unit keys of their own; report this with the --data file's unit field"
        )
    return keys


def unit_canary_data(
    plan: RunPlan, examples: torch.Tensor, included: Any, records: int
) -> tuple[torch.Tensor, list[str]]:
    """The training blocks and the included canary units' blocks (canary i's M blocks are rows
    ``i·M … i·M + M − 1`` of ``examples``), and every row's unit."""
    import numpy as np
    import torch

    assert plan.units is not None
    count = int(examples.shape[0]) // records
    keys = canary_unit_keys(count, plan.units)
    chosen = np.flatnonzero(np.asarray(included, dtype=bool))
    grouped = examples.view(count, records, -1)
    inserted = grouped[torch.as_tensor(chosen, dtype=torch.long)].reshape(-1, examples.shape[1])
    units = list(plan.units) + [keys[i] for i in chosen.tolist() for _ in range(records)]
    return torch.cat([plan.train, inserted]), units


def unit_scores(reduction: torch.Tensor, *, records: int) -> torch.Tensor:
    """A canary unit's score: the mean loss reduction over its ``records`` blocks."""
    return reduction.view(-1, records).mean(dim=1)


def unit_notes(plan: RunPlan, records: int) -> list[str]:
    """What the plan says about canary units beyond the audit line: capped like any unit."""
    cap = plan.settings.max_records_per_unit
    if cap is None or cap >= records:
        return []
    note = (
        f"--max-records-per-unit {cap} < --canary-records {records}: canary units are capped "
        f"too — each step a drawn canary unit brings a random {cap} of its {records} blocks, as "
        f"any {plan.unit_name} with more than {cap} blocks does (the per-unit guarantee holds "
        f"either way; --canary-records {cap} inserts no block the cap leaves out)"
    )
    return [note]


def unit_audit_line(plan: RunPlan, count: int, records: int) -> str:
    """The printout's ``audit`` line of a user-level audit."""
    s = plan.settings
    return (
        f"audit     {count} input canaries, each one {plan.unit_name} of {records} random-token "
        f"blocks under a key of its own, included with probability ½ as a whole, next to "
        f"{plan.population:,} {plan.unit_name}s ({plan.dataset_size:,} training blocks); σ = "
        f"{plan.noise_multiplier:.4g}, C = {s.clip:g}, q = {plan.sample_rate:.4g} per unit, "
        f"{plan.steps} steps, planned ε = {plan.planned_epsilon:.3g} per {plan.unit_name} at "
        f"δ = {plan.delta:.3g}"
    )


def unit_result(result: AuditResult) -> AuditResult:
    """The result with its advice for a user-level audit: gradient canaries, which a
    black-box audit is told to try, are not available as units."""
    advice = tuple(
        dataclasses.replace(
            a,
            change="canary_kind_unavailable",
            text="input canaries are scored by the trained model's loss (black-box), far weaker "
            "than the white-box attack the expected figure assumes; gradient canaries, which see "
            "every step, are single examples and not available as units",
        )
        if a.change == "canary_kind"
        else a
        for a in result.advice
    )
    return dataclasses.replace(result, advice=advice)


def unit_report(plan: RunPlan, records: int, included: int) -> dict[str, Any]:
    """``audit.json``'s figures of a user-level audit: the unit, and the canary units."""
    cap = plan.settings.max_records_per_unit
    return {
        "privacy_unit": plan.unit_name,
        "epsilon_per": plan.unit_name,
        "units": plan.population,
        "canary_records": records,
        "canary_records_per_step": records if cap is None else min(records, cap),
        "canary_units_included": included,
        "max_records_per_unit": cap,
        "canaries_are": (
            f"units: each canary is one {plan.unit_name} of {records} random-token blocks under a "
            "key no data unit has, included or left out as a whole; scores are the mean loss "
            "reduction over its blocks, and the bound is on ε per unit"
        ),
    }
