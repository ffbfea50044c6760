"""The whole conformance check of one book-keeping rule, in one call (public: plugin authors).

:func:`check_rule` runs :func:`~opake.core.testing.search_rule` on every example the rule
declares. A rule that is not registered (a module of your own, not installed as a plugin yet) is
registered for the duration of the check, as a plugin registered in code, and unregistered
after; an installed plugin's rule is checked by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from opake.core.plugins import hookimpl
from opake.core.testing._rules import rule_example_cases, search_rule

if TYPE_CHECKING:
    from opake.core.plugins import BookkeepingRule

__all__ = ["check_rule"]


class _OneRule:
    """A plugin registering one rule (what :func:`check_rule` registers for its check)."""

    def __init__(self, rule: BookkeepingRule) -> None:
        self.rule = rule

    @hookimpl
    def opake_bookkeeping_rules(self) -> list[BookkeepingRule]:
        return [self.rule]


@contextlib.contextmanager
def _registered(rule: BookkeepingRule) -> Iterator[None]:
    """``rule`` among ``registered_rules()`` while the block runs."""
    from opake.core.errors import ConfigurationError
    from opake.core.plugins import register_plugin, unregister_plugin
    from opake.dpsgd.bookkeeping import registered_rules

    known = {r.name: r for r in registered_rules()}
    if rule.name in known:
        if known[rule.name] != rule:
            raise ConfigurationError(
                f"check_rule: a different book-keeping rule named {rule.name!r} is already "
                "registered (an installed plugin's or a built-in one); rename your rule or check "
                f"the registered one with check_rule({rule.name!r})"
            )
        yield
        return
    name = register_plugin(_OneRule(rule), f"opake.core.testing:{rule.name}")
    try:
        yield
    finally:
        unregister_plugin(name)


def check_rule(rule: BookkeepingRule | str, *, max_examples: int = 8) -> int:
    """Run the conformance check on every example of ``rule`` (a
    :class:`~opake.core.plugins.BookkeepingRule`, or the name of a registered one); returns the
    number of examples checked.

    For each module the rule's ``example()`` returns, hypothesis searches ``max_examples``
    adversarial batches besides four fixed ones (:func:`~opake.core.testing.search_rule`) and
    checks, through ``clipped_grad(engine="bookkeeping")``: the plan puts the module under
    ``rule``; every example's contribution is at most the clipping bound (no tolerance beyond
    the oracle's fp64 rounding); the batch's sum is the sum of the contributions; for moderate
    inputs, the sum equals the per-example loop of plain autograd in fp64. The rule's
    ``eager``, ``keeps_output`` and ``broadcast`` take effect as in training; a rule with
    ``implicit`` pieces is trusted for the check.

    Raises ``AssertionError`` on the first violation, or the engine's
    :class:`~opake.core.errors.OperationError` when it refuses the rule's pieces (a missing
    attribute, a piece of another kind than declared, norms that differ from autograd). Needs
    ``hypothesis``.

    >>> check_rule("layer_norm", max_examples=1)
    1
    """
    from opake.core.errors import ConfigurationError, InputTypeError
    from opake.core.plugins import BookkeepingRule
    from opake.dpsgd.bookkeeping import registered_rules

    if isinstance(rule, str):
        found = [r for r in registered_rules() if r.name == rule]
        if not found:
            names = [r.name for r in registered_rules()]
            raise ConfigurationError(
                f"no registered book-keeping rule named {rule!r}; registered: {names}. Pass the "
                "BookkeepingRule itself to check a rule that is not installed"
            )
        rule = found[0]
    if not isinstance(rule, BookkeepingRule):
        raise InputTypeError(
            f"check_rule takes a BookkeepingRule or a registered rule's name, got "
            f"{type(rule).__name__}"
        )
    with _registered(rule):
        cases = rule_example_cases([rule])
        for name, index in cases:
            search_rule(name, index, max_examples=max_examples)
    return len(cases)
