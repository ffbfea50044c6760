"""The DP-SGD optimizer step for any ``torch.optim`` optimizer.

:class:`DPOptimizer` takes the clipped gradient sums that
``opake.dpsgd.clipping.clipped_grad`` returns (one per physical batch), adds Gaussian noise once
per logical step in fp32, divides by the *expected* batch size, writes the result into each
parameter's ``.grad``, steps the wrapped optimizer and records the step in the accountant. Each
step returns a :class:`StepReport`. ``offload_state=True`` keeps the optimizer state in CPU
memory. :func:`autocast_loss` wraps a per-example loss for bf16/fp16 compute with fp32
gradients (fp16: a static loss scale removed before clipping). See ``docs/guide/training.md``.

Example:
    >>> import torch
    >>> from opake.dpsgd.optimizer import DPOptimizer
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = DPOptimizer(torch.optim.AdamW(net.parameters()), net, noise_multiplier=1.0,
    ...                   expected_batch_size=8.0, seed=0)
    >>> opt.param_names
    ('weight', 'bias')
"""

from __future__ import annotations

from opake.dpsgd.optimizer._dp_optimizer import DPOptimizer, StepReport
from opake.dpsgd.optimizer._precision import DEFAULT_FP16_LOSS_SCALE, autocast_loss
from opake.dpsgd.optimizer._unused import lora_a_note

__all__ = ["DEFAULT_FP16_LOSS_SCALE", "DPOptimizer", "StepReport", "autocast_loss", "lora_a_note"]
