"""A memory-aware default for ``DPTrainer``'s per-device microbatch (``microbatch_size=None``).

Before the first step, ``DPTrainer`` estimates the peak of one physical batch: it measures two
small probe steps (1 and :data:`PROBE_EXAMPLES` examples at a time, on random tokens of the
longest training example's length; the data's values are never used) with
:func:`opake.profiling.tune_microbatch` as the measuring device, and draws a straight line through
them, ``peak(m) = base + m × per example``. The whole physical batch runs at once when the line
puts its largest likely size (the expected Poisson batch plus five standard deviations) within
the limit; otherwise the batch is computed in microbatches of the largest power of two the line
puts within it. The limit is ``memory_budget_gb`` when given, else half of the memory available
to the process (the line is an estimate; evaluation, checkpoints and the rest of the machine
need room too).

The choice is privacy-neutral: a microbatch only chunks the clipped per-example sum of a batch,
never which examples are clipped or how.

>>> line = MemoryLine(base_gb=1.0, per_example_gb=0.25)
>>> line.peak_gb(8)
3.0
>>> choose_microbatch(line, limit_gb=2.6, largest=12, expected=8)
4
>>> choose_microbatch(line, limit_gb=10.0, largest=12, expected=8) is None
True
>>> largest_batch(16, 0.1, 1000)
35
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "LIMIT_FRACTION",
    "PROBE_EXAMPLES",
    "MemoryLine",
    "MicrobatchChoice",
    "choose_microbatch",
    "default_microbatch",
    "largest_batch",
    "longest_example",
    "measure_line",
]

logger = logging.getLogger("opake.transformers")

#: examples of the larger probe step (the smaller one computes one example)
PROBE_EXAMPLES = 4
#: share of the available memory a physical batch may use when no memory_budget_gb is given
LIMIT_FRACTION = 0.5
#: standard deviations above the expected Poisson batch that a physical batch is sized for
_POISSON_SIGMAS = 5.0


@dataclass(frozen=True)
class MemoryLine:
    """The estimated peak of a physical batch against the examples computed at once (GiB)."""

    base_gb: float
    per_example_gb: float

    def peak_gb(self, examples: int) -> float:
        """The estimated peak when *examples* are computed at once."""
        return self.base_gb + self.per_example_gb * examples


@dataclass(frozen=True)
class MicrobatchChoice:
    """The per-device microbatch ``DPTrainer`` chose, and why.

    Attributes:
        microbatch: examples per chunk of a physical batch; ``None``: the whole batch at once.
        reason: one line saying what was estimated against which limit.
    """

    microbatch: int | None
    reason: str


def largest_batch(expected: float, sample_rate: float, cap: int) -> int:
    """The largest physical batch a step is sized for: the expected Poisson batch plus five
    standard deviations (a larger one comes less than once in three million steps), at most
    *cap*."""
    spread = math.sqrt(max(0.0, expected * (1.0 - sample_rate)))
    return max(1, min(cap, math.ceil(expected + _POISSON_SIGMAS * spread)))


def choose_microbatch(
    line: MemoryLine, *, limit_gb: float, largest: int, expected: int
) -> int | None:
    """``None`` (the whole batch at once) when *line* puts *largest* examples within
    *limit_gb*; else the largest power of two, at most *expected*, that it puts within the
    limit (at least 1)."""
    if line.peak_gb(largest) <= limit_gb:
        return None
    room = limit_gb - line.base_gb
    fits = int(room // line.per_example_gb) if line.per_example_gb > 0 else largest
    fits = max(1, min(fits, expected))
    return 1 << (fits.bit_length() - 1)


def longest_example(dataset: Any) -> int | None:
    """The most tokens of any example's ``input_ids`` (``None``: the rows have none)."""
    try:
        column = dataset["input_ids"]  # a datasets.Dataset: the column at once
        if isinstance(column, list):
            return max((len(ids) for ids in column), default=None)
    except (KeyError, TypeError, IndexError, ValueError):
        pass
    longest = None
    for index in range(len(dataset)):
        row = dataset[index]
        ids = row.get("input_ids") if isinstance(row, Mapping) else None
        if ids is None:
            return None
        longest = max(longest or 0, len(ids))
    return longest


def _probe_batch(task: str, config: Any, k: int, length: int, vocab: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (k, length), generator=gen)
    if task == "causal_lm":
        return {"input_ids": ids, "labels": ids.clone()}
    num_labels = int(getattr(config, "num_labels", 2))
    problem = getattr(config, "problem_type", None)
    if num_labels == 1 or problem in ("regression", "multi_label_classification"):
        labels = torch.zeros(k, num_labels)
    else:
        labels = torch.randint(0, num_labels, (k,), generator=gen)
    return {"input_ids": ids, "labels": labels}


def measure_line(
    make_grad_fn: Callable[[int], Any],
    params: tuple[Any, ...],
    batch: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
) -> MemoryLine:
    """Measure the peak with 1 and ``len(batch)`` examples at once and fit :class:`MemoryLine`
    (the global random state is left as it was).

    Raises:
        ConfigurationError: not even one example at a time fits in memory.
    """
    import torch

    from opake.profiling import NoMicrobatchFitsError, tune_microbatch

    k = int(next(iter(batch.values())).shape[0])
    on_device = {name: value.to(device) for name, value in batch.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            result = tune_microbatch(
                make_grad_fn,
                (*params, on_device),
                batch_size=k,
                device=device,
                memory_budget_gb=1e9,  # measure, do not judge: the choice is made from the line
                candidates=sorted({k, 1}, reverse=True),
                steps=1,
                warmup_steps=1,
                compare_smaller=1,
            )
        except NoMicrobatchFitsError as err:
            raise ConfigurationError(
                f"DPTrainer: one training example at a time does not fit in memory ({err}); "
                "shorten the examples, train fewer parameters (LoRA) or turn on "
                "gradient_checkpointing"
            ) from None
    points = sorted(
        (c.microbatch_size, c.memory_peak_gb)
        for c in result.candidates
        if c.fits and c.memory_peak_gb is not None
    )
    if not points:
        return MemoryLine(base_gb=0.0, per_example_gb=math.inf)
    if len(points) < 2:  # the larger probe ran out of memory: assume it cost the rest
        (m1, p1) = points[0]
        return MemoryLine(base_gb=p1, per_example_gb=0.0 if m1 == k else math.inf)
    (m1, p1), (m2, p2) = points[0], points[-1]
    per_example = max(0.0, (p2 - p1) / (m2 - m1))
    return MemoryLine(base_gb=p1 - per_example * m1, per_example_gb=per_example)


def _available_gb(device: torch.device) -> float | None:
    from opake.profiling import get_memory_stats

    stats = get_memory_stats(device)
    if stats.free_gb is None:
        return None
    held = stats.reserved_gb if stats.reserved_gb is not None else stats.allocated_gb
    return (held or 0.0) + stats.free_gb


def default_microbatch(
    make_grad_fn: Callable[[int], Any],
    params: tuple[Any, ...],
    *,
    task: str,
    model_config: Any,
    vocab: int | None,
    length: int | None,
    expected: int,
    largest: int,
    device: torch.device,
    budget_gb: float | None,
) -> MicrobatchChoice:
    """The per-device microbatch for a physical batch of *expected* (up to *largest*) examples
    of up to *length* tokens, measured with *make_grad_fn* (``m -> clipped-gradient step``)."""
    whole = "whole physical batch at once"
    if task not in ("causal_lm", "sequence_classification"):
        return _chosen(None, f"{whole} (a custom per_example_loss: no probe batch to measure)")
    if length is None or vocab is None:
        return _chosen(None, f"{whole} (the training examples have no input_ids to size a probe)")
    if budget_gb is not None:
        limit, of = budget_gb, f"memory_budget_gb={budget_gb:g}"
    else:
        available = _available_gb(device)
        if available is None:
            return _chosen(None, f"{whole} (this device reports no free memory to plan with)")
        limit, of = LIMIT_FRACTION * available, f"half of the {available:.1f} GB available"
    batch = _probe_batch(task, model_config, min(PROBE_EXAMPLES, largest), length, vocab)
    line = measure_line(make_grad_fn, params, batch, device=device)
    peak = line.peak_gb(largest)
    m = choose_microbatch(line, limit_gb=limit, largest=largest, expected=expected)
    if m is None:
        return _chosen(
            None,
            f"{whole}: up to {largest} examples of {length} tokens are estimated to peak at "
            f"{peak:.2f} GB, within {of} ({limit:.2f} GB)",
        )
    estimate = line.peak_gb(m)
    reason = (
        f"microbatch_size {m}: a whole physical batch (up to {largest} examples of {length} "
        f"tokens) is estimated to peak at {_gb(peak)}, more than {of} ({limit:.2f} GB); {m} "
        f"example{'s' if m > 1 else ''} at a time: {_gb(estimate)} estimated (privacy-neutral: "
        "it only chunks the clipped per-example sum; set microbatch_size or memory_budget_gb "
        "to choose otherwise)"
    )
    if estimate > limit:
        reason += "; even one example at a time is estimated above the limit"
    return _chosen(m, reason)


def _chosen(m: int | None, reason: str) -> MicrobatchChoice:
    logger.info("per-device microbatch (microbatch_size not set): %s", reason)
    return MicrobatchChoice(m, reason)


def _gb(value: float) -> str:
    return "more memory than measured" if math.isinf(value) else f"{value:.2f} GB"
