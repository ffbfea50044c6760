"""Stateless (functional) views of PyTorch modules, for per-example gradients.

:func:`make_functional` turns a module into ``fmodel(params, *args, **kwargs)`` plus its
parameter dict(s), the form :func:`opake.dpsgd.clipping.clipped_grad` differentiates. With
``partition_trainable=True`` only the trainable parameters (e.g. LoRA adapters) are exposed to
``vmap``, so per-example gradients are materialised for them alone. :func:`cached_signature` makes
``apply`` of a ``torch.autograd.Function`` with ``setup_context`` cheaper (every Opake Function
uses it). :func:`outside_transforms` skips a value-inspecting check inside ``torch.func``
transforms (:func:`in_transform` says whether the caller is inside one).

>>> import torch
>>> from opake.functional import make_functional
>>> fmodel, params = make_functional(torch.nn.Linear(2, 1))
>>> sorted(params)
['bias', 'weight']
>>> fmodel(params, torch.zeros(1, 2)).shape
torch.Size([1, 1])
"""

from __future__ import annotations

from opake.functional._autograd import cached_signature
from opake.functional._make_functional import FunctionalModel, make_functional
from opake.functional._transforms import in_transform, outside_transforms

__all__ = [
    "FunctionalModel",
    "cached_signature",
    "in_transform",
    "make_functional",
    "outside_transforms",
]
