"""How many examples ``opake train`` computes at once: a memory-aware default for ``--microbatch``.

Without ``--microbatch`` the run estimates the peak of one step before training: it measures two
small probe steps on random tokens of the real shape (1 and :data:`PROBE_EXAMPLES` examples at
once, with :func:`opake.profiling.tune_microbatch` as the measuring device, never on the data)
and draws a straight line through them, ``peak(m) = base + m × per example``. The whole Poisson
batch runs at once when the line puts its largest likely size within the memory limit; otherwise
the batch is computed in microbatches of the largest power of two the line puts within the limit.
The limit is ``--memory-budget`` when given, else half of the available memory (the line is an
estimate, and evaluation, checkpoints and the rest of the machine need room too); without a
stated budget the microbatches use half of the room that limit leaves above the model (the line
is extrapolated from a few examples, and larger chunks do not run faster once the device is
busy). The choice is privacy-neutral: a microbatch only chunks the clipped per-example sum.

Not in ``opake.profiling`` because it needs the run's step (the CLI's clipped-gradient
function) and its Poisson batch; it only calls that distribution's public API.

>>> line = MemoryLine(base_gb=1.0, per_example_gb=0.25, probes=((1, 1.25), (4, 2.0)))
>>> line.peak_gb(8)
3.0
>>> choose_microbatch(line, limit_gb=2.6, largest_batch=12, expected_batch=8)
4
>>> choose_microbatch(line, limit_gb=10.0, largest_batch=12, expected_batch=8) is None
True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.cli._plan import RunPlan

__all__ = [
    "AUTO_FRACTION",
    "CHUNK_FRACTION",
    "PROBE_EXAMPLES",
    "TUNE_FRACTION",
    "MemoryLine",
    "MicrobatchChoice",
    "available_memory_gb",
    "choose_microbatch",
    "largest_batch",
    "measure_line",
    "microbatch_for_run",
]

_log = logging.getLogger("opake.cli")

#: examples of the larger probe step (the smaller one computes one example); large enough that
#: the extrapolation to a whole batch stays short (a probe of 4 put SmolLM2's step at 128
#: examples 26% below its measured peak)
PROBE_EXAMPLES = 16
#: share of the available memory a step may use when no --memory-budget is given
AUTO_FRACTION = 0.5
#: share of the room above the model (within that limit) the microbatches are sized to, when
#: the limit is not a stated budget
CHUNK_FRACTION = 0.5
#: share of the available memory ``--microbatch auto`` tunes within when no --memory-budget is
#: given (the tuner measures each size, so it may go closer to the limit than an estimate)
TUNE_FRACTION = 0.8
#: standard deviations above the expected Poisson batch that a step's batch is sized for
_POISSON_SIGMAS = 5.0


@dataclass(frozen=True)
class MemoryLine:
    """The estimated step peak as a function of the examples computed at once (GiB).

    Attributes:
        base_gb: the peak with no example (model, optimizer, the rest of the process).
        per_example_gb: what each example computed at once adds.
        probes: the measured ``(examples at once, peak GiB)`` points.
    """

    base_gb: float
    per_example_gb: float
    probes: tuple[tuple[int, float], ...]

    def peak_gb(self, examples: int) -> float:
        """The estimated peak of a step that computes *examples* at once."""
        return self.base_gb + self.per_example_gb * examples

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (for ``summary.json``)."""
        return {
            "base_gb": self.base_gb,
            "per_example_gb": self.per_example_gb if math.isfinite(self.per_example_gb) else None,
            "probes": [list(p) for p in self.probes],
        }


@dataclass(frozen=True)
class MicrobatchChoice:
    """What ``opake train`` computes at once, and why (one line for the plan).

    Attributes:
        microbatch: examples per chunk; ``None`` for the whole batch at once.
        reason: the plan's ``memory`` line.
        line: the estimate the choice was made from (``None`` when nothing was estimated).
        limit_gb: the memory limit the estimate was held to.
        table: the tuner's table (``--microbatch auto``), else empty.
    """

    microbatch: int | None
    reason: str
    line: MemoryLine | None = None
    limit_gb: float | None = None
    table: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (for ``summary.json``)."""
        return {
            "microbatch": self.microbatch,
            "reason": self.reason,
            "estimate": None if self.line is None else self.line.to_dict(),
            "limit_gb": self.limit_gb,
        }


def available_memory_gb(device: torch.device) -> float | None:
    """Memory this process may grow to on *device*, in GiB: what it holds now plus what is free
    (CPU: resident set size plus the machine's or the cgroup's available memory); ``None`` when
    the device does not report it."""
    from opake.profiling import get_memory_stats

    stats = get_memory_stats(device)
    if stats.free_gb is None:
        return None
    held = stats.reserved_gb if stats.reserved_gb is not None else stats.allocated_gb
    return (held or 0.0) + stats.free_gb


def largest_batch(expected: float, sample_rate: float, cap: int) -> int:
    """The largest batch a step is sized for: the expected Poisson batch plus five standard
    deviations (a larger one comes less than once in three million steps), at most *cap*.

    >>> largest_batch(128, 0.1, 10_000)
    182
    """
    spread = math.sqrt(max(0.0, expected * (1.0 - sample_rate)))
    return max(1, min(cap, math.ceil(expected + _POISSON_SIGMAS * spread)))


def measure_line(
    make: Callable[[int], Any],
    params: tuple[Any, ...],
    *,
    block_size: int,
    vocab: int,
    device: torch.device,
) -> MemoryLine:
    """Measure the step peak with 1 and :data:`PROBE_EXAMPLES` examples at once (random tokens;
    the global random state is left as it was) and fit :class:`MemoryLine` through them. When
    the larger probe does not fit, a quarter of it is tried instead.

    Raises:
        ConfigurationError: not even one example at a time fits in memory.
    """
    import torch

    devices = [device] if device.type == "cuda" else []
    points: list[tuple[int, float]] = []
    with torch.random.fork_rng(devices=devices):
        one = _probe(make, params, 1, block_size=block_size, vocab=vocab, device=device)
        if one is None:
            raise ConfigurationError(
                f"one example of {block_size} tokens at a time does not fit in memory; use a "
                "smaller --block-size, --lora-r, or --checkpointing"
            )
        points.append((1, one))
        k = PROBE_EXAMPLES
        while k > 1:
            peak = _probe(make, params, k, block_size=block_size, vocab=vocab, device=device)
            if peak is not None:
                points.append((k, peak))
                break
            k //= 4
    if len(points) < 2:  # no larger probe fitted: assume each example costs the rest
        return MemoryLine(base_gb=one, per_example_gb=math.inf, probes=tuple(points))
    (m1, p1), (m2, p2) = points
    per_example = max(0.0, (p2 - p1) / (m2 - m1))
    return MemoryLine(
        base_gb=p1 - per_example * m1, per_example_gb=per_example, probes=tuple(points)
    )


def _probe(
    make: Callable[[int], Any],
    params: tuple[Any, ...],
    examples: int,
    *,
    block_size: int,
    vocab: int,
    device: torch.device,
) -> float | None:
    """The peak (GiB) of a step computing *examples* random blocks at once, measured by the
    tuner (a warm-up step, then a measured one); ``None`` when it runs out of memory."""
    import torch

    from opake.profiling import NoMicrobatchFitsError, tune_microbatch

    tokens = torch.randint(
        0, vocab, (examples, block_size), generator=torch.Generator().manual_seed(examples)
    ).to(device)
    try:
        result = tune_microbatch(
            make,
            (*params, tokens),
            batch_size=examples,
            device=device,
            memory_budget_gb=1e9,  # measure, do not judge: the choice is made from the line
            candidates=[examples],
            steps=1,
            warmup_steps=1,
            compare_smaller=0,
        )
    except NoMicrobatchFitsError:
        return None
    return result.candidates[0].memory_peak_gb


def choose_microbatch(
    line: MemoryLine, *, limit_gb: float, largest_batch: int, expected_batch: int
) -> int | None:
    """``None`` (the whole batch at once) when *line* puts *largest_batch* within *limit_gb*;
    else the largest power of two, at most *expected_batch*, that it puts within the limit
    (at least 1)."""
    if line.peak_gb(largest_batch) <= limit_gb:
        return None
    room = limit_gb - line.base_gb
    fits = int(room // line.per_example_gb) if line.per_example_gb > 0 else largest_batch
    fits = max(1, min(fits, expected_batch))
    return 1 << (fits.bit_length() - 1)


def default_choice(
    line: MemoryLine,
    *,
    budget_gb: float | None,
    available_gb: float | None,
    expected_batch: int,
    largest: int,
) -> MicrobatchChoice:
    """The default ``--microbatch`` for *line*, with the plan's line saying why."""
    if budget_gb is not None:
        limit, of = budget_gb, f"--memory-budget {budget_gb:g} GB"
    elif available_gb is not None:
        limit = AUTO_FRACTION * available_gb
        of = f"half of the {available_gb:.1f} GB available ({limit:.2f} GB)"
    else:
        return MicrobatchChoice(
            None, "whole batch at once (this device reports no free memory to plan with)"
        )
    whole = line.peak_gb(largest)
    m = None
    if whole > limit:
        # chunks are sized to the budget given, or use half of the room the default limit
        # leaves above the model (the base of the line): the line is extrapolated from a few
        # examples, and larger chunks no longer run faster once the device is busy (on a CPU,
        # 16 examples at a time ran twice as fast as 128)
        chunk_limit = limit
        if budget_gb is None:
            chunk_limit = line.base_gb + CHUNK_FRACTION * max(0.0, limit - line.base_gb)
        m = choose_microbatch(
            line, limit_gb=chunk_limit, largest_batch=largest, expected_batch=expected_batch
        )
        m = 1 if m is None else m
    if m is None:
        reason = (
            f"whole batch at once: a Poisson batch of up to {largest} examples is estimated to "
            f"peak at {whole:.2f} GB, within {of}"
        )
    else:
        estimate = line.peak_gb(m)
        sized = (
            "within the budget"
            if budget_gb is not None
            else "using half of the room above the model"
        )
        reason = (
            f"--microbatch auto → {m}: a whole Poisson batch (up to {largest} examples) is "
            f"estimated to peak at {_gb(whole)}, more than {of}; "
            f"{m} example{'s' if m > 1 else ''} at a time: {_gb(estimate)} estimated, "
            f"{sized} "
            "(privacy-neutral; --microbatch N or --memory-budget GB to choose otherwise)"
        )
        if estimate > limit:
            reason += "; even one example at a time is estimated above the limit"
    _log.info("--microbatch (default): %s", reason)
    return MicrobatchChoice(m, reason, line, limit)


def microbatch_for_run(
    plan: RunPlan,
    loss: Any,
    params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    *,
    device: torch.device,
    world_size: int,
    randomness: str,
) -> MicrobatchChoice:
    """``--microbatch N`` as given; otherwise measure the step's memory line on random tokens
    (never the private data) and choose from it (the default), or tune within it (``auto``)."""
    s = plan.settings
    if isinstance(s.microbatch, int):
        return MicrobatchChoice(s.microbatch, f"--microbatch {s.microbatch} (given)")
    from opake.dpsgd.clipping import clipped_grad

    def make(microbatch: int | None) -> Any:
        # the same gradient function as the run's, on a probe that is not the private data
        return clipped_grad(
            loss,
            argnums=0,
            clipping_norm=s.clip,
            batch_argnums=2,
            microbatch_size=microbatch,
            return_aux=True,
            method=plan.engine,
            randomness=randomness,
        )

    # this rank's share of the global Poisson batch: expected, and the largest sized for
    expected = plan.sample_rate * plan.dataset_size / world_size
    cap = plan.max_batch_size or plan.dataset_size
    largest = largest_batch(expected, plan.sample_rate, math.ceil(cap / world_size))
    line = measure_line(
        make,
        params,
        block_size=s.block_size,
        vocab=int(plan.train.max()) + 1,
        device=device,
    )
    available = available_memory_gb(device)
    if s.microbatch == "auto":
        from opake.cli._setup import _tune_microbatch

        return _tune_microbatch(
            make,
            params,
            plan,
            device=device,
            world_size=world_size,
            line=line,
            available_gb=available,
        )
    return default_choice(
        line,
        budget_gb=s.memory_budget,
        available_gb=available,
        expected_batch=max(1, math.ceil(expected)),
        largest=largest,
    )


def _gb(value: float) -> str:
    return "more memory than measured" if math.isinf(value) else f"{value:.2f} GB"
