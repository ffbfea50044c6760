"""DP-SGD training as one object: the step composed once, for any training loop.

:class:`DPTraining` holds the Poisson sampler, the clipped-gradient function (engine
``auto``), the DP optimizer, the accountant and the privacy budget. A loop draws index batches
from :meth:`DPTraining.batches`, loads the examples and calls :meth:`DPTraining.step` (or
:meth:`DPTraining.accumulate` per physical batch, then :meth:`DPTraining.finish_step`); ε is
:meth:`DPTraining.epsilon`, the budget :attr:`DPTraining.steps_left` (a step past
``target_epsilon`` raises :class:`PrivacyBudgetExhausted` before touching data), the whole
state :meth:`DPTraining.state_dict` / :meth:`DPTraining.save` (atomic). Hooks receive each
step's :class:`StepResult` (diagnostics, not private). ``opake train`` and
``opake.transformers.DPTrainer`` are built on it.

Example:
    >>> import torch
    >>> from opake.dpsgd.training import DPTraining
    >>> from opake.functional import make_functional
    >>> net = torch.nn.Linear(4, 1)
    >>> fmodel, params = make_functional(net)
    >>> def loss_fn(p, x):  # the loss of one example
    ...     return fmodel(p, x[None]).pow(2).sum()
    >>> training = DPTraining(loss_fn, torch.optim.SGD(net.parameters(), lr=0.1), params,
    ...                       dataset_size=200, expected_batch_size=20, target_epsilon=2.0,
    ...                       steps=50, delta=1e-5, accountant="rdp", seed=0)
    >>> data = torch.randn(200, 4)
    >>> results = [training.step(data[i]) for _, i in zip(range(50), training.batches())]
    >>> training.exhausted, training.epsilon() <= 2.0
    (True, True)
"""

from __future__ import annotations

from opake.core.choices import SAMPLERS
from opake.dpsgd.training._dp_training import DPTraining, PrivacyBudgetExhausted, StepResult

__all__ = ["SAMPLERS", "DPTraining", "PrivacyBudgetExhausted", "StepResult"]
