"""A memory-aware default for ``DPTrainer``'s per-device microbatch (``microbatch_size=None``).

Before the first step, ``DPTrainer`` estimates the peak of one physical batch with
:func:`opake.profiling.measure_memory_line`: two small probe steps (1 and
:data:`opake.profiling.PROBE_EXAMPLES` examples at a time, on random tokens of the longest
training example's length; the data's values are never used), and a straight line through them,
``peak(m) = base + m × per example``. The whole physical batch runs at once when the line puts
its largest likely size (the expected Poisson batch plus five standard deviations,
:func:`opake.profiling.largest_poisson_batch`) within the limit; otherwise the batch is computed
in microbatches of the largest power of two the line puts within it
(:func:`opake.profiling.choose_microbatch`). The limit is ``memory_budget_gb`` when given, else
half of the memory available to the process (the line is an estimate; evaluation, checkpoints
and the rest of the machine need room too).

The choice is privacy-neutral: a microbatch only chunks the clipped per-example sum of a batch,
never which examples are clipped or how. What is ``DPTrainer``'s own: the probe batch's labels
for its task, the limit's fraction, the argument names in the reason, and its logger.

>>> import torch
>>> build = probe_batch("sequence_classification", None)
>>> {name: tuple(value.shape) for name, value in build(torch.ones(2, 5, dtype=torch.long)).items()}
{'input_ids': (2, 5), 'labels': (2,)}
>>> longest_example([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
3
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
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

    from opake.dpsgd.clipping import ClippedGradFn, ClipState

__all__ = [
    "LIMIT_FRACTION",
    "MicrobatchChoice",
    "default_microbatch",
    "longest_example",
    "measure_line",
    "probe_batch",
    "trainer_microbatch",
]

logger = logging.getLogger("opake.transformers")

#: share of the available memory a physical batch may use when no memory_budget_gb is given
LIMIT_FRACTION = 0.5


@dataclass(frozen=True)
class MicrobatchChoice:
    """The per-device microbatch ``DPTrainer`` chose, and why.

    Attributes:
        microbatch: examples per chunk of a physical batch; ``None``: the whole batch at once.
        reason: one line saying what was estimated against which limit.
    """

    microbatch: int | None
    reason: str


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


def probe_batch(task: str, config: Any) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """The probe batch of *task* built from random token ids: the ids as labels (causal LM), or
    labels of the classification head's shape drawn from them (the values do not matter)."""

    def build(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        if task == "causal_lm":
            return {"input_ids": ids, "labels": ids.clone()}
        k = ids.shape[0]
        num_labels = int(getattr(config, "num_labels", 2))
        problem = getattr(config, "problem_type", None)
        if num_labels == 1 or problem in ("regression", "multi_label_classification"):
            labels = torch.zeros(k, num_labels, device=ids.device)
        else:
            labels = ids[:, 0] % num_labels
        return {"input_ids": ids, "labels": labels}

    return build


def measure_line(
    make_grad_fn: Callable[[int], Any],
    params: tuple[Any, ...],
    *,
    task: str,
    model_config: Any,
    length: int,
    vocab: int,
    largest: int,
    device: torch.device,
) -> MemoryLine:
    """The memory line of a physical batch (:func:`opake.profiling.measure_memory_line` on
    :func:`probe_batch`, at most *largest* examples at once).

    Raises:
        ConfigurationError: not even one example at a time fits in memory.
    """
    try:
        return measure_memory_line(
            make_grad_fn,
            params,
            length=length,
            vocab=vocab,
            device=device,
            largest=largest,
            batch=probe_batch(task, model_config),
        )
    except NoMicrobatchFitsError as err:
        raise ConfigurationError(
            f"DPTrainer: one training example at a time does not fit in memory ({err}); "
            "shorten the examples, train fewer parameters (LoRA) or turn on "
            "gradient_checkpointing"
        ) from None


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
        available = available_memory_gb(device)
        if available is None:
            return _chosen(None, f"{whole} (this device reports no free memory to plan with)")
        limit, of = LIMIT_FRACTION * available, f"half of the {available:.1f} GB available"
    line = measure_line(
        make_grad_fn,
        params,
        task=task,
        model_config=model_config,
        length=length,
        vocab=vocab,
        largest=largest,
        device=device,
    )
    peak = line.peak_gb(largest)
    m = choose_microbatch(line, limit_gb=limit, largest_batch=largest, expected_batch=expected)
    if m is None:
        return _chosen(
            None,
            f"{whole}: up to {largest} examples of {length} tokens are estimated to peak at "
            f"{peak:.2f} GB, within {of} ({limit:.2f} GB)",
        )
    estimate = line.peak_gb(m)
    reason = (
        f"microbatch_size {m}: a whole physical batch (up to {largest} examples of {length} "
        f"tokens) is estimated to peak at {format_gb(peak)}, more than {of} ({limit:.2f} GB); "
        f"{m} example{'s' if m > 1 else ''} at a time: {format_gb(estimate)} estimated "
        "(privacy-neutral: "
        "it only chunks the clipped per-example sum; set microbatch_size or memory_budget_gb "
        "to choose otherwise)"
    )
    if estimate > limit:
        reason += "; even one example at a time is estimated above the limit"
    return _chosen(m, reason)


def _chosen(m: int | None, reason: str) -> MicrobatchChoice:
    logger.info("per-device microbatch (microbatch_size not set): %s", reason)
    return MicrobatchChoice(m, reason)


def trainer_microbatch(
    trainer: Any,
    loss: Any,
    params: tuple[Any, ...],
    *,
    rows: int,
    length: int | None,
    randomness: str,
    max_batch: int | None,
    sizes: tuple[int, int] | None = None,
    engine: str | None = None,
) -> MicrobatchChoice:
    """:func:`default_microbatch` for a DP trainer's physical batches: *loss* is what the probe
    differentiates, *rows* the rows of the forward one example is (two for a DPO pair),
    *length* the most tokens of a row, *max_batch* the fixed-shape sampler's slots (or
    ``None``: Poisson batches, up to the expected size plus five standard deviations); *sizes*:
    the expected and largest examples of a physical batch when the caller knows them better
    (privacy units bring their records); *engine*: the one the DP step uses (default
    ``args.engine``; the vmap engine when the step is compiled)."""
    from opake.dpsgd.clipping import AutoSClipping, clipped_grad
    from opake.transformers._losses import base_model

    a = trainer.args
    model = trainer.model
    n = trainer._dataset_size()
    chunks = a.gradient_accumulation_steps * a.world_size
    if sizes is not None:
        expected, largest = sizes
    elif max_batch is not None:  # fixed shapes: every physical batch has this many slots
        expected = largest = -(-max_batch // chunks)
    else:
        expected = int(a.per_device_train_batch_size)
        logical_expected = trainer._expected_batch_size()
        logical = largest_poisson_batch(logical_expected, logical_expected / n, n)
        largest = -(-logical // chunks)

    def make_grad_fn(m: int) -> tuple[ClippedGradFn, ClipState]:
        clip: Any = a.per_sample_max_grad_norm
        if a.clipping == "automatic":
            clip = AutoSClipping(clipping_norm=a.per_sample_max_grad_norm)
        return clipped_grad(
            loss,
            argnums=0,
            clipping_norm=clip,
            batch_argnums=(2,),
            microbatch_size=m,
            randomness=randomness,
            engine=a.engine if engine is None else engine,
            check_unused=False,
        )

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    return default_microbatch(
        make_grad_fn,
        params,
        task=trainer._task,
        model_config=getattr(base_model(model), "config", None),
        vocab=getattr(embeddings, "num_embeddings", None),
        length=length,
        expected=expected * rows,
        largest=largest * rows,
        device=a.device,
        budget_gb=a.memory_budget_gb,
    )
