"""``torch_compile=True`` for the DP trainers: the DP step compiled once, by ``DPTraining``.

The Hugging Face Trainer applies ``torch_compile`` by giving accelerate a dynamo plugin, which
wraps the prepared model in ``torch.compile`` for the Trainer's own forward passes. The DP step
never calls that forward: it differentiates the model functionally, so it compiles its own
clipped-gradient computation (``DPTraining(compile=True)``, one batch shape: the book-keeping
engine's batched forward and backward for a full model, the vmap engine's whole step for
adapters or with dropout). The trainer therefore asks accelerate for no model compile
(:func:`accelerator_args_without_compile`; evaluation runs eager) and gives the DP step one
shape:

- rows: each physical batch runs as chunks of :func:`chunk_rows` rows — ``microbatch_size``,
  else the automatic microbatch, else the physical batch (``per_device_train_batch_size`` for
  Poisson batches, the slots of a fixed-shape one); the last chunk is padded with masked rows
  that add exactly zero;
- tokens: every training batch is padded to the longest training example
  (:func:`sequence_length`): a graph compiled for one length would compile again for each new
  one, and torch gives up on a whole-graph function after eight.

What does not compile is refused at construction
(:func:`opake.transformers._refusals.check_compile`): privacy units, a backend or mode other
than the default.
"""

from __future__ import annotations

import logging
from typing import Any

from opake.core.errors import OperationError

__all__ = [
    "accelerator_args_without_compile",
    "check_model_not_compiled",
    "chunk_rows",
    "dp_engine",
    "sequence_length",
]

logger = logging.getLogger("opake.transformers")


def dp_engine(args: Any) -> str:
    """The per-example engine of the DP step (``engine``); with ``torch_compile`` the DP step
    says at its first call which one it compiled (logged on ``opake.core``)."""
    engine: str = args.engine
    if getattr(args, "torch_compile", False) and engine == "auto":
        logger.info(
            "torch_compile=True: engine 'auto' compiles the book-keeping engine's batched "
            "forward and backward for a full model, the vmap engine's whole step for adapters "
            "or with dropout (chosen at the first step)"
        )
    return engine


def chunk_rows(args: Any, microbatch: int | None, *, max_batch: int | None) -> int | None:
    """The rows of each compiled call: *microbatch* (given or chosen automatically), else the
    physical batch — its slots with fixed shapes (*max_batch*: the logical batch's), else
    ``per_device_train_batch_size`` (a larger Poisson batch runs as more chunks). Without
    ``torch_compile``: *microbatch* unchanged."""
    if not getattr(args, "torch_compile", False):
        return microbatch
    from opake.dpsgd.training._compile import compiled_rows

    slots = None
    if max_batch is not None:  # the slots are a multiple of the physical batches
        slots = max_batch // int(args.gradient_accumulation_steps * args.world_size)
    per_device = (int(args.per_device_train_batch_size), "per_device_train_batch_size")
    rows, why = compiled_rows(microbatch, fixed_rows=slots, poisson=per_device)
    logger.info(
        "torch_compile=True: the DP step compiles once, for chunks of %d rows (%s); each "
        "physical batch runs as such chunks, the last one padded with masked rows",
        rows,
        why,
    )
    return rows


def sequence_length(args: Any, dataset: Any) -> int | None:
    """The tokens every training batch is padded to with ``torch_compile``: the longest
    training example of *dataset*; else ``None`` (each batch to its own longest example)."""
    from opake.transformers._microbatch import longest_example

    if not getattr(args, "torch_compile", False):
        return None
    longest = longest_example(dataset)
    if longest is None:
        logger.warning(
            "torch_compile=True: the training examples have no input_ids to find the longest, "
            "so batches keep their own lengths; each new length compiles the DP step again "
            "and torch stops after eight: pad the examples to one length"
        )
    return longest


def accelerator_args_without_compile(accelerator_args: dict[str, Any]) -> dict[str, Any]:
    """*accelerator_args* with a dynamo plugin that compiles no model (the DP step compiles
    its own computation; the Trainer's compiled forward would serve evaluation only)."""
    from accelerate.utils import TorchDynamoPlugin

    return {**accelerator_args, "dynamo_plugin": TorchDynamoPlugin(backend="no")}


def check_model_not_compiled(trainer: Any) -> None:
    """Raise ``OperationError`` if the Trainer's accelerator would still wrap the model in
    ``torch.compile`` (a transformers or accelerate version that configures it elsewhere)."""
    if not getattr(trainer.args, "torch_compile", False):
        return
    from accelerate.utils import DynamoBackend

    plugin = getattr(trainer.accelerator.state, "dynamo_plugin", None)
    backend = getattr(plugin, "backend", DynamoBackend.NO)
    if backend != DynamoBackend.NO:
        raise OperationError(
            f"{type(trainer).__name__}: torch_compile=True, and the Trainer's accelerator would "
            f"also compile the model (dynamo backend {backend}); the DP step compiles on its "
            "own and this installed transformers/accelerate configures the model compile in a "
            "way DPTrainer does not know: train with torch_compile=False"
        )
