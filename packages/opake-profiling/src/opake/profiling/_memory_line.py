"""A memory-aware microbatch estimate: a straight line through two measured probe steps.

A front end (``opake train``, ``DPTrainer``) that must pick how many examples of a batch a
step computes at once, before the first step, measures two small probe steps on random tokens
(1 and :data:`PROBE_EXAMPLES` examples at once, never the data) with :func:`tune_microbatch` as
the measuring device, and draws a straight line through them: ``peak(m) = base + m × per
example`` (:func:`measure_memory_line`). The whole batch runs at once when the line puts its
largest likely size (:func:`largest_poisson_batch`) within a memory limit; otherwise it runs in
microbatches of the largest power of two the line puts within the limit
(:func:`choose_microbatch`). :func:`available_memory_gb` is what the process may grow to, a
natural base for that limit. The choice is privacy-neutral when the microbatches only chunk a
clipped per-example sum.

The probe of :data:`PROBE_EXAMPLES` (16) examples keeps the extrapolation to a whole batch short:
a probe of 4 put SmolLM2's step at 128 examples 26% below its measured peak.

Example:
    >>> from opake.profiling import MemoryLine, choose_microbatch, largest_poisson_batch
    >>> line = MemoryLine(base_gb=1.0, per_example_gb=0.25, probes=((1, 1.25), (16, 5.0)))
    >>> line.peak_gb(8)
    3.0
    >>> largest_poisson_batch(8, 0.1, cap=12)
    12
    >>> choose_microbatch(line, limit_gb=2.6, largest_batch=12, expected_batch=8)
    4
    >>> choose_microbatch(line, limit_gb=10.0, largest_batch=12, expected_batch=8) is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.profiling._errors import NoMicrobatchFitsError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROBE_EXAMPLES",
    "MemoryLine",
    "available_memory_gb",
    "choose_microbatch",
    "format_gb",
    "largest_poisson_batch",
    "measure_memory_line",
]

#: examples of the larger probe step (the smaller one computes one example); large enough that
#: the extrapolation to a whole batch stays short (a probe of 4 put SmolLM2's step at 128
#: examples 26% below its measured peak)
PROBE_EXAMPLES = 16
#: standard deviations above the expected Poisson batch that a batch is sized for
_POISSON_SIGMAS = 5.0


@dataclass(frozen=True)
class MemoryLine:
    """The estimated step peak as a function of the examples computed at once (GiB).

    Attributes:
        base_gb: the peak with no example (model, optimizer, the rest of the process).
        per_example_gb: what each example computed at once adds (``math.inf``: a larger probe
            did not fit, so nothing above the measured examples is known to fit).
        probes: the measured ``(examples at once, peak GiB)`` points.

    Example:
        >>> line = MemoryLine(base_gb=0.5, per_example_gb=float("inf"), probes=((1, 0.75),))
        >>> line.to_dict()
        {'base_gb': 0.5, 'per_example_gb': None, 'probes': [[1, 0.75]]}
    """

    base_gb: float
    per_example_gb: float
    probes: tuple[tuple[int, float], ...] = ()

    def peak_gb(self, examples: int) -> float:
        """The estimated peak of a step that computes *examples* at once."""
        return self.base_gb + self.per_example_gb * examples

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (an infinite ``per_example_gb`` is ``None``)."""
        return {
            "base_gb": self.base_gb,
            "per_example_gb": self.per_example_gb if math.isfinite(self.per_example_gb) else None,
            "probes": [list(p) for p in self.probes],
        }


def largest_poisson_batch(expected: float, sample_rate: float, cap: int) -> int:
    """The largest batch a step is sized for under Poisson sampling: the expected batch plus
    five standard deviations (a larger one comes less than once in three million steps), at
    least 1 and at most *cap*.

    Args:
        expected: the expected batch (``sample_rate × dataset size``, or a rank's share of it).
        sample_rate: the probability that an example is in the batch.
        cap: the most examples a batch can hold (the dataset, a fixed number of slots).

    Example:
        >>> largest_poisson_batch(128, 0.1, 10_000)
        182
        >>> largest_poisson_batch(16, 0.1, 20)
        20
    """
    spread = math.sqrt(max(0.0, expected * (1.0 - sample_rate)))
    return max(1, min(cap, math.ceil(expected + _POISSON_SIGMAS * spread)))


def choose_microbatch(
    line: MemoryLine, *, limit_gb: float, largest_batch: int, expected_batch: int
) -> int | None:
    """``None`` (the whole batch at once) when *line* puts *largest_batch* examples within
    *limit_gb*; else the largest power of two, at most *expected_batch*, that it puts within
    the limit (at least 1, even when one example is estimated above it).

    Example:
        >>> line = MemoryLine(base_gb=1.0, per_example_gb=0.125)
        >>> [choose_microbatch(line, limit_gb=g, largest_batch=40, expected_batch=16)
        ...  for g in (100.0, 3.0, 1.5, 0.5)]
        [None, 16, 4, 1]
    """
    if line.peak_gb(largest_batch) <= limit_gb:
        return None
    room = limit_gb - line.base_gb
    fits = int(room // line.per_example_gb) if line.per_example_gb > 0 else largest_batch
    fits = max(1, min(fits, expected_batch))
    return 1 << (fits.bit_length() - 1)


def format_gb(value: float) -> str:
    """A memory estimate for a message (an unbounded per-example cost reads as such).

    >>> format_gb(1.234), format_gb(math.inf)
    ('1.23 GB', 'more memory than measured')
    """
    return "more memory than measured" if math.isinf(value) else f"{value:.2f} GB"


def available_memory_gb(device: torch.device | str) -> float | None:
    """Memory this process may grow to on *device*, in GiB: what it holds now plus what is free
    (CPU: resident set size plus the machine's or the cgroup's available memory); ``None`` when
    the device does not report free memory.

    Example:
        >>> from opake.profiling import available_memory_gb
        >>> available_memory_gb("cpu") > 0
        True
    """
    from opake.profiling._memory import get_memory_stats

    stats = get_memory_stats(device)
    if stats.free_gb is None:
        return None
    held = stats.reserved_gb if stats.reserved_gb is not None else stats.allocated_gb
    return (held or 0.0) + stats.free_gb


def measure_memory_line(
    make_grad_fn: Callable[[int], Any],
    args: Sequence[Any],
    *,
    length: int,
    vocab: int,
    device: torch.device | str,
    examples: int = PROBE_EXAMPLES,
    largest: int | None = None,
    batch: Callable[[torch.Tensor], Any] | None = None,
) -> MemoryLine:
    """Measure the step peak with 1 and *examples* examples at once and fit :class:`MemoryLine`
    through the two points. When the larger probe does not fit, a quarter of it is tried, and a
    quarter of that, while more than one example; when none fits, ``per_example_gb`` is
    ``math.inf``.

    Each probe is a :func:`tune_microbatch` run of one candidate (a warm-up step, then a
    measured one) of ``make_grad_fn(k)(*args, batch(tokens))``, where ``tokens`` are ``k`` rows
    of *length* random token ids below *vocab*, on *device* (the data's values are never used:
    memory does not depend on them). The global random state is left as it was.

    Args:
        make_grad_fn: builds the step for a microbatch size (as for :func:`tune_microbatch`).
        args: the step's arguments before the batch (params, ...).
        length: tokens per probe example (the longest the step will see).
        vocab: token ids are drawn below it.
        device: where the step runs; its memory is measured.
        examples: the larger probe's examples.
        largest: the most examples the step will compute at once: the larger probe takes
            no more (``None``: no cap).
        batch: builds the step's batch from the token ids (default: the ids themselves), e.g.
            ``lambda ids: {"input_ids": ids, "labels": ids}``.

    Raises:
        NoMicrobatchFitsError: not even one example at a time fits (from :func:`tune_microbatch`,
            its ``.result`` holds the measurement).

    Example:
        >>> import torch
        >>> from opake.profiling import measure_memory_line
        >>> table = torch.randn(100, 256)
        >>> def make_grad_fn(m):
        ...     return lambda ids: [table[chunk].sum() for chunk in ids.split(m)]
        >>> line = measure_memory_line(make_grad_fn, (), length=32, vocab=100, device="cpu")
        >>> [k for k, _ in line.probes], line.per_example_gb >= 0
        ([1, 16], True)
    """
    import torch

    dev = torch.device(device)
    step_batch = batch if batch is not None else _identity
    if largest is not None:
        examples = max(1, min(examples, largest))

    def probe(k: int) -> float | None:
        return _probe(
            make_grad_fn, args, k, length=length, vocab=vocab, device=dev, batch=step_batch
        )

    points: list[tuple[int, float | None]] = []
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        points.append((1, probe(1)))
        k = examples
        while k > 1:
            try:
                points.append((k, probe(k)))
                break
            except NoMicrobatchFitsError:
                k //= 4
    return _fit(points, larger=examples > 1)


def _fit(points: list[tuple[int, float | None]], *, larger: bool) -> MemoryLine:
    """The line through the measured points, the one-example probe first (*larger*: a larger
    probe was asked for)."""
    measured = tuple((k, peak) for k, peak in points if peak is not None)
    if not measured or measured[0][0] != 1:  # the device reports no peak: nothing is known
        return MemoryLine(base_gb=0.0, per_example_gb=math.inf, probes=measured)
    (m1, p1) = measured[0]
    if len(measured) < 2:
        # none larger fitted (or reported its peak): assume each example costs the rest; with
        # one example as the largest batch, the point itself is the line
        per_example = math.inf if larger else 0.0
        return MemoryLine(base_gb=p1, per_example_gb=per_example, probes=measured)
    (m2, p2) = measured[1]
    per_example = max(0.0, (p2 - p1) / (m2 - m1))
    return MemoryLine(base_gb=p1 - per_example * m1, per_example_gb=per_example, probes=measured)


def _identity(tokens: torch.Tensor) -> torch.Tensor:
    return tokens


def _probe(
    make_grad_fn: Callable[[int], Any],
    args: Sequence[Any],
    examples: int,
    *,
    length: int,
    vocab: int,
    device: torch.device,
    batch: Callable[[torch.Tensor], Any],
) -> float | None:
    """The peak (GiB) of a step computing *examples* random rows at once, measured by the
    tuner; ``None`` when the device reports no peak. Raises NoMicrobatchFitsError."""
    import torch

    from opake.profiling._tuner import tune_microbatch

    tokens = torch.randint(
        0, vocab, (examples, length), generator=torch.Generator().manual_seed(examples)
    ).to(device)
    result = tune_microbatch(
        make_grad_fn,
        (*args, batch(tokens)),
        batch_size=examples,
        device=device,
        memory_budget_gb=1e9,  # measure, do not judge: the choice is made from the line
        candidates=[examples],
        steps=1,
        warmup_steps=1,
        compare_smaller=0,
    )
    return result.candidates[0].memory_peak_gb
