"""How many records ``max_length`` truncates (or drops), counted while TRL prepares the data.

A record stays one example (the privacy unit) whatever its length: truncation cuts each record
on its own. What it costs is utility, so it is counted and reported — logged on the
``opake.transformers`` logger, kept in ``trainer.truncation`` and added to the training summary
log as ``truncated_records`` / ``dropped_records``. These counts describe the training data
and are **not private** (like every diagnostic).

- SFT: a record whose tokens exceed ``max_length`` is truncated; one left without any target
  token (its completion cut away) is dropped by TRL.
- DPO: a record whose prompt + chosen or prompt + rejected exceeds ``max_length`` is
  truncated (when collated); one whose prompt alone fills ``max_length`` (``keep_start``) is
  dropped by TRL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["Truncation", "count_dpo", "count_sft", "report", "with_counts"]

logger = logging.getLogger("opake.transformers")


@dataclass(frozen=True)
class Truncation:
    """What ``max_length`` did to one dataset.

    Attributes:
        records: records before truncation.
        truncated: records cut to ``max_length`` (and kept).
        dropped: records removed (nothing left to train on after the cut).
        max_length: the limit.
    """

    records: int
    truncated: int
    dropped: int
    max_length: int


def _lengths(dataset: Any, column: str) -> list[int]:
    return [len(ids) for ids in dataset[column]]


def count_sft(untruncated: Any, max_length: int, keep_start: bool) -> Truncation:
    """Count TRL's tokenised SFT records before truncation (``input_ids`` and ``labels``): those
    longer than ``max_length`` and kept, and those TRL drops (no target token left after the
    cut, ``keep_start`` keeping the first ``max_length`` tokens, else the last)."""
    truncated = dropped = 0
    records = 0
    for ids, labels in zip(untruncated["input_ids"], untruncated["labels"], strict=True):
        records += 1
        kept = labels[:max_length] if keep_start else labels[-max_length:]
        if all(label == -100 for label in kept):
            dropped += 1
        elif len(ids) > max_length:
            truncated += 1
    return Truncation(records, truncated, dropped, max_length)


def count_dpo(prepared: Any, max_length: int, keep_start: bool) -> tuple[Truncation, list[int]]:
    """Count TRL's tokenised preference records; returns the counts and the indices of the
    records to keep (TRL drops those whose prompt alone fills ``max_length``, ``keep_start``)."""
    prompts = _lengths(prepared, "prompt_ids")
    chosen = _lengths(prepared, "chosen_ids")
    rejected = _lengths(prepared, "rejected_ids")
    keep = [i for i, p in enumerate(prompts) if not (keep_start and p >= max_length)]
    longer = sum(1 for i in keep if prompts[i] + max(chosen[i], rejected[i]) > max_length)
    return Truncation(len(prompts), longer, len(prompts) - len(keep), max_length), keep


def report(trainer: str, name: str, counts: Truncation) -> None:
    """Log the counts: a warning when any record was cut or dropped."""
    if not (counts.truncated or counts.dropped):
        logger.info(
            "%s: %s data: no record longer than max_length=%d (%d records)",
            trainer,
            name,
            counts.max_length,
            counts.records,
        )
        return
    logger.warning(
        "%s: %s data: %d of %d records are longer than max_length=%d and were truncated; "
        "%d dropped (nothing left to train on). Each record is still one example, cut on its "
        "own; raise max_length to keep more of them (counts of the data: not private)",
        trainer,
        name,
        counts.truncated,
        counts.records,
        counts.max_length,
        counts.dropped,
    )


def with_counts(logs: dict[str, float], counts: Truncation | None) -> dict[str, float]:
    """*logs* with the truncation counts added to the training summary (the log holding
    ``train_runtime``); other logs unchanged."""
    if counts is None or "train_runtime" not in logs:
        return logs
    return {**logs, "truncated_records": counts.truncated, "dropped_records": counts.dropped}
