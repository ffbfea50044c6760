"""Per-example losses for post-training (SFT and DPO), for ``clipped_grad`` / ``DPTraining``.

Each loss is a batched per-example loss ``fn(trainable, frozen, batch) -> [rows]`` to wrap in
:class:`~opake.dpsgd.bookkeeping.BatchedLoss`, so it runs on both clipping engines (book-keeping
and ``vmap``), with the patched model's loss-only head where it has one:

- :func:`completion_losses` (SFT): one record is one example; its loss is the mean negative
  log-likelihood over its own completion tokens (``labels`` -100 on the prompt, on a
  conversation's non-assistant turns and on padding), so prompt tokens get no gradient;
- :class:`DPOLoss` (DPO): one preference pair is one example, its chosen and rejected rows
  clipped together as one privacy unit; :func:`dpo_losses` and :func:`dpo_weights` are its
  arithmetic, :func:`sequence_log_probs` the summed completion log-probability of a row;
  :func:`accumulate_pairs` clips pairs weighed by the book-keeping forward itself, when
  :func:`weighs_in_forward` says the step allows it.

``opake.transformers.trl.DPSFTTrainer`` and ``DPDPOTrainer`` use them; so can a hand-written
``DPTraining`` loop (``docs/guide/post-training.md``).

>>> import opake.transformers.losses as losses
>>> print(", ".join(sorted(losses.__all__)[:3]))
DPOLoss, PAIR_KEYS, PairsNeedBookkeepingError
"""

from __future__ import annotations

from opake.transformers.losses._completion import (
    completion_losses,
    loss_only_available,
    sequence_log_probs,
    target_counts,
)
from opake.transformers.losses._dpo import (
    PAIR_KEYS,
    WEIGHT_KEY,
    DPOLoss,
    PairsNeedBookkeepingError,
    PreparedPairs,
    SeenPairs,
    dpo_losses,
    dpo_losses_from_margins,
    dpo_weights,
)
from opake.transformers.losses._in_forward import accumulate_pairs, weighs_in_forward

__all__ = [
    "PAIR_KEYS",
    "WEIGHT_KEY",
    "DPOLoss",
    "PairsNeedBookkeepingError",
    "PreparedPairs",
    "SeenPairs",
    "accumulate_pairs",
    "completion_losses",
    "dpo_losses",
    "dpo_losses_from_margins",
    "dpo_weights",
    "loss_only_available",
    "sequence_log_probs",
    "target_counts",
    "weighs_in_forward",
]
