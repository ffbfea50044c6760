"""The registry of layer rules: the built-in modules of :mod:`.rules` and the plugins' rules."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from opake.core._dotted import resolve_dotted
from opake.core.errors import ConfigurationError
from opake.dpsgd.bookkeeping._trust import TRUST_ENV, implicit_outside_proof

if TYPE_CHECKING:
    import torch

    from opake.core.plugins import BookkeepingRule

__all__ = ["BUILTIN_RULES", "builtin_rules", "registered_rules", "rule_for", "untrusted"]

_log = logging.getLogger("opake.core")

#: the built-in rules by name, in the order they are tried, each with where it is defined
#: (``module:attribute`` in :mod:`opake.dpsgd.bookkeeping.rules`; one module may hold several
#: rules, as ``norm`` holds both of PyTorch's norm modules)
BUILTIN_RULES: Mapping[str, str] = MappingProxyType(
    {
        "linear": "linear:RULE",
        "conv1d": "conv1d:RULE",
        "embedding": "embedding:RULE",
        "layer_norm": "norm:LAYER_NORM",
        "rms_norm": "norm:RMS_NORM",
        "per_layer": "per_layer:RULE",
    }
)


def builtin_rules() -> tuple[BookkeepingRule, ...]:
    """The built-in rules, in :data:`BUILTIN_RULES` order.

    >>> [rule.name for rule in builtin_rules()][:2]
    ['linear', 'conv1d']
    """
    from opake.core.plugins import BookkeepingRule

    out = []
    for name, where in BUILTIN_RULES.items():
        rule = resolve_dotted(f"opake.dpsgd.bookkeeping.rules.{where}")
        if not isinstance(rule, BookkeepingRule) or rule.name != name:  # pragma: no cover
            raise ConfigurationError(f"rules.{where} must be a BookkeepingRule named {name!r}")
        out.append(rule)
    return tuple(out)


def registered_rules() -> tuple[BookkeepingRule, ...]:
    """Every rule the engine tries, in order: highest ``priority`` first, built-in rules before
    plugins' rules of the same priority. A name registered twice raises
    :class:`~opake.core.errors.ConfigurationError` naming both.

    >>> names = [rule.name for rule in registered_rules()]
    >>> names[0], names[-1]
    ('linear', 'per_layer')
    """
    from opake.core.plugins import bookkeeping_rules

    rules = list(builtin_rules())
    seen = {rule.name for rule in rules}
    for name, rule in bookkeeping_rules().items():
        if name in seen:
            raise ConfigurationError(
                f"book-keeping rule {name!r} is registered by a plugin and is also a built-in "
                "rule; rename the plugin's rule"
            )
        rules.append(rule)
    order = {id(rule): i for i, rule in enumerate(rules)}
    return tuple(sorted(rules, key=lambda r: (-r.priority, order[id(r)])))


def untrusted(rules: tuple[BookkeepingRule, ...], trusted: frozenset[str]) -> dict[str, str]:
    """Rule name → why it is skipped: rules with implicit pieces outside the proof (registered
    by a distribution other than Opake's own) that are not in the ``trusted`` list."""
    from opake.core.plugins import bookkeeping_rule_origins

    builtin = {rule.name for rule in builtin_rules()}
    origins = bookkeeping_rule_origins()
    out = {}
    for rule in rules:
        origin = origins.get(rule.name)
        kinds = rule.produces.values()
        if rule.name not in trusted and implicit_outside_proof(kinds, origin, rule.name in builtin):
            out[rule.name] = (
                f"rule {rule.name!r} (from {origin or 'code'}) holds per-example gradients in "
                "an operator outside the clipping proof and is not trusted (name it in "
                f"clipped_grad(trusted_rules=...) or {TRUST_ENV})"
            )
    return out


def rule_for(
    module: torch.nn.Module,
    attrs: frozenset[str],
    rules: tuple[BookkeepingRule, ...],
    skipped: dict[str, str] | None = None,
) -> tuple[BookkeepingRule | None, str]:
    """The first of ``rules`` that matches ``module`` with differentiated ``attrs``:
    ``(rule, "")``, or ``(None, why)`` when a rule refused the module (explicitly, by a reason)
    or none matched. Rules in ``skipped`` (name → reason, see :func:`untrusted`) are passed
    over, their reason logged on ``opake.core`` when they would have matched."""
    for rule in rules:
        if any(rule.kind_of(attr) is None for attr in attrs):
            continue
        if skipped and rule.name in skipped:
            if rule.load_matches()(module, attrs) is True:
                _log.info(
                    "book-keeping: %s; its layer %s uses the next rule",
                    skipped[rule.name],
                    type(module).__name__,
                )
            continue
        verdict = rule.load_matches()(module, attrs)
        if isinstance(verdict, str):
            return None, verdict
        if verdict is True:
            return rule, ""
        if verdict is not False:
            raise ConfigurationError(
                f"book-keeping rule {rule.name!r}: matches() returned {verdict!r}; expected "
                "True, False or a string saying why the module cannot be handled"
            )
    return None, f"no book-keeping rule matches {type(module).__name__} with {sorted(attrs)}"
