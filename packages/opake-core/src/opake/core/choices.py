"""The names Opake's entry points accept, in one light module (no torch, no numpy).

The library validates against these lists and every front end (``opake`` command,
``DPTrainingArguments``) offers exactly them, so a new engine, sampler or accountant is one edit
here. They are re-exported where users look for them: :data:`opake.dpsgd.clipping.ENGINES`,
:data:`opake.dpsgd.training.SAMPLERS`, :data:`opake.accounting.ACCOUNTANTS` and
:data:`opake.accounting.TRAINING_PLD_OPTIONS`.

>>> from opake.core import choices
>>> choices.ENGINES
('auto', 'vmap', 'bookkeeping')
>>> dict(choices.TRAINING_PLD_OPTIONS)
{'value_discretization_interval': 0.001}
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["ACCOUNTANTS", "ENGINES", "SAMPLERS", "TRAINING_PLD_OPTIONS"]

#: per-example engines of ``clipped_grad(engine=...)`` (``"auto"`` picks one per call)
ENGINES: tuple[str, ...] = ("auto", "vmap", "bookkeeping")
#: samplers of ``DPTraining(sampler=...)``: Poisson, or fixed-shape truncated Poisson
SAMPLERS: tuple[str, ...] = ("poisson", "fixed")
#: privacy accountants of ``make_accountant(kind)`` (``accountant=`` everywhere)
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
#: The PLD accountant options of the training front ends (``opake train``, ``opake audit``,
#: ``DPTrainer``): a grid 10× coarser than the library default, so accounting a long run takes
#: seconds; ε stays an upper bound (rounded up), a little looser. Copy it before changing it.
TRAINING_PLD_OPTIONS: Mapping[str, float] = MappingProxyType(
    {"value_discretization_interval": 1e-3}
)
