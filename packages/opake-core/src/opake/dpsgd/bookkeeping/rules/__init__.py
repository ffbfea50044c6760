"""Book-keeping layer rules: one module per kind of layer, and what a rule author needs.

A rule is a :class:`~opake.core.plugins.BookkeepingRule`: what it matches, the per-example
gradient pieces it produces from one recorded :class:`LayerUse`, and a :class:`RuleExample`
the conformance harness runs it on (:func:`opake.core.testing.check_rule`). Built-in rules are
listed by name in :data:`BUILTIN_RULES`, each with the ``module:attribute`` of this package
that defines it (``linear:RULE``; ``norm`` defines both ``layer_norm`` and ``rms_norm``); a
third-party distribution returns its rules from the ``opake_bookkeeping_rules`` hook. See the
README beside this file.

>>> from opake.dpsgd.bookkeeping.rules import registered_rules
>>> "rms_norm" in [rule.name for rule in registered_rules()]
True
"""

from __future__ import annotations

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._pieces import Dense, Implicit, ImplicitGrad, OuterSum, Piece
from opake.dpsgd.bookkeeping._registry import (
    BUILTIN_RULES,
    builtin_rules,
    registered_rules,
    rule_for,
)
from opake.dpsgd.bookkeeping._use import (
    LayerRule,
    LayerUse,
    RuleExample,
    first_input,
    flat_batch,
)
from opake.dpsgd.bookkeeping.rules._norm import last_dim_normalised, norm_pieces

__all__ = [
    "BUILTIN_RULES",
    "BookkeepingRule",
    "Dense",
    "Implicit",
    "ImplicitGrad",
    "LayerRule",
    "LayerUse",
    "OuterSum",
    "Piece",
    "RuleExample",
    "builtin_rules",
    "first_input",
    "flat_batch",
    "last_dim_normalised",
    "norm_pieces",
    "registered_rules",
    "rule_for",
]
