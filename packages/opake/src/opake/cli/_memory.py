"""How many examples ``opake train`` computes at once: a memory-aware default for ``--microbatch``.

Without ``--microbatch`` the run estimates the peak of one step before training with
:func:`opake.profiling.measure_memory_line`: two small probe steps on random tokens of the real
shape (1 and :data:`opake.profiling.PROBE_EXAMPLES` examples at once, never the data), and a
straight line through them, ``peak(m) = base + m × per example``. The whole Poisson batch runs at
once when the line puts its largest likely size within the memory limit; otherwise the batch is
computed in microbatches of the largest power of two the line puts within the limit
(:func:`opake.profiling.choose_microbatch`). The limit is ``--memory-budget`` when given, else
half of the available memory (the line is an estimate, and evaluation, checkpoints and the rest
of the machine need room too); without a stated budget the microbatches use half of the room
that limit leaves above the model (the line is extrapolated from a few examples, and larger
chunks do not run faster once the device is busy). The choice is privacy-neutral: a microbatch
only chunks the clipped per-example sum.

What is the CLI's own: the run's step (its clipped-gradient function) and Poisson batch, the
fractions of the available memory, the options named in the plan's ``memory`` line, and that
line's wording.

>>> from opake.profiling import MemoryLine
>>> line = MemoryLine(base_gb=1.0, per_example_gb=0.25, probes=((1, 1.25), (16, 5.0)))
>>> tight = default_choice(line, budget_gb=2.6, available_gb=None, expected_batch=8, largest=12)
>>> tight.microbatch, tight.reason.split(":")[0]
(4, '--microbatch auto → 4')
>>> roomy = default_choice(line, budget_gb=None, available_gb=20.0, expected_batch=8, largest=12)
>>> roomy.microbatch is None, roomy.reason.split(":")[0]
(True, 'whole batch at once')
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError
from opake.profiling import (
    MemoryLine,
    NoMicrobatchFitsError,
    available_memory_gb,
    choose_microbatch,
    format_gb,
    largest_poisson_batch,
    measure_memory_line,
)

if TYPE_CHECKING:
    import torch

    from opake.cli._plan import RunPlan
    from opake.dpsgd.clipping import ClippedGradFn, ClipState

__all__ = [
    "AUTO_FRACTION",
    "CHUNK_FRACTION",
    "TUNE_FRACTION",
    "MicrobatchChoice",
    "default_choice",
    "measure_line",
    "microbatch_for_run",
]

_log = logging.getLogger("opake.cli")

#: share of the available memory a step may use when no --memory-budget is given
AUTO_FRACTION = 0.5
#: share of the room above the model (within that limit) the microbatches are sized to, when
#: the limit is not a stated budget
CHUNK_FRACTION = 0.5
#: share of the available memory ``--microbatch auto`` tunes within when no --memory-budget is
#: given (the tuner measures each size, so it may go closer to the limit than an estimate)
TUNE_FRACTION = 0.8


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


def measure_line(
    make: Callable[[int], Any],
    params: tuple[Any, ...],
    *,
    block_size: int,
    vocab: int,
    largest: int,
    device: torch.device,
    batch: Callable[[torch.Tensor], Any] | None = None,
) -> MemoryLine:
    """The step's memory line (:func:`opake.profiling.measure_memory_line` on random blocks, at
    most *largest* examples at once; *batch* builds the step's batch from the token ids).

    Raises:
        ConfigurationError: not even one example at a time fits in memory.
    """
    try:
        return measure_memory_line(
            make,
            params,
            length=block_size,
            vocab=vocab,
            device=device,
            largest=largest,
            batch=batch,
        )
    except NoMicrobatchFitsError:
        raise ConfigurationError(
            f"one example of {block_size} tokens at a time does not fit in memory; use a "
            "smaller --block-size, --lora-r, or --checkpointing"
        ) from None


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
            f"estimated to peak at {format_gb(whole)}, more than {of}; "
            f"{m} example{'s' if m > 1 else ''} at a time: {format_gb(estimate)} estimated, "
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
    post: Any = None,
) -> MicrobatchChoice:
    """``--microbatch N`` as given; otherwise measure the step's memory line on random tokens
    (never the private data) and choose from it (the default), or tune within it (``auto``).

    With SFT or DPO records (*post*, a :class:`~opake.cli._posttrain.PostStep`) the probe is
    one row's completion loss, ``post.rows`` rows per record, and the microbatch counts records.
    With ``--compile`` and Poisson batches the whole batch is one chunk of its largest likely
    size (:func:`~opake.cli._compiling.compiled_choice`)."""
    s = plan.settings
    if isinstance(s.microbatch, int):
        return MicrobatchChoice(s.microbatch, f"--microbatch {s.microbatch} (given)")
    from opake.dpsgd.clipping import clipped_grad

    rows = 1 if post is None else post.rows
    probe_loss = loss if post is None else post.row_loss

    def make(microbatch: int | None) -> tuple[ClippedGradFn, ClipState]:
        # the same gradient function as the run's, on a probe that is not the private data
        return clipped_grad(
            probe_loss,
            argnums=0,
            clipping_norm=s.clip,
            batch_argnums=2,
            microbatch_size=None if microbatch is None else microbatch * rows,
            return_aux=True,
            engine=plan.engine,
            randomness=randomness,
        )

    # this rank's share of the global Poisson batch: expected, and the largest sized for
    if plan.units is not None:  # units bring their blocks (one process: ranks are refused)
        from opake.dpsgd.sampling import unit_batch_rows

        expected, largest = unit_batch_rows(plan.units, plan.sample_rate, s.max_records_per_unit)
    else:
        expected = plan.sample_rate * plan.dataset_size / world_size
        cap = plan.max_batch_size or plan.dataset_size
        largest = largest_poisson_batch(expected, plan.sample_rate, math.ceil(cap / world_size))
    line = measure_line(
        make,
        params,
        block_size=int(plan.train.shape[-1]),  # a block, or the longest record's row
        vocab=int(plan.train.max()) + 1,
        largest=largest,
        device=device,
        batch=None if post is None else post.probe_batch,
    )
    available = available_memory_gb(device)  # looked up here at call time: tests replace it
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
            batch=None if post is None else post.probe_batch,
        )
    choice = default_choice(
        line,
        budget_gb=s.memory_budget,
        available_gb=available,
        expected_batch=max(1, math.ceil(expected)),
        largest=largest,
    )
    if s.compile and plan.max_batch_size is None:
        from opake.cli._compiling import compiled_choice

        return compiled_choice(choice, largest=largest)
    return choice
