"""The plan: which registered rule handles each layer that reads a differentiated parameter."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opake.dpsgd.bookkeeping._registry import registered_rules, rule_for, untrusted
from opake.dpsgd.bookkeeping._trust import trusted_names
from opake.dpsgd.bookkeeping._use import LayerRule

__all__ = ["BookkeepingPlan", "bookkeeping_plan"]


@dataclass(frozen=True)
class BookkeepingPlan:
    """The rule of every layer that reads a differentiated parameter, and what has none.

    >>> import torch
    >>> plan = bookkeeping_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0.weight"])
    >>> [(layer.module, layer.rule) for layer in plan.layers], plan.supported
    ([('0', 'linear')], True)
    """

    layers: tuple[LayerRule, ...]
    unsupported: tuple[tuple[str, str], ...] = ()

    @property
    def supported(self) -> bool:
        """True when every differentiated parameter has a rule."""
        return not self.unsupported

    def explain(self) -> str:
        """One line per layer (module, rule, parameters), then what is unsupported and why."""
        lines = [
            f"{layer.module or '<root>'}: {layer.rule} ({', '.join(n for _, n in layer.params)})"
            for layer in self.layers
        ]
        lines += [f"UNSUPPORTED {what}: {why}" for what, why in self.unsupported]
        return "\n".join(lines)


def bookkeeping_plan(
    model: Any, names: Iterable[str], *, trusted: Iterable[str] = ()
) -> BookkeepingPlan:
    """Which rule handles each layer reading one of the differentiated parameters ``names``.

    ``model`` is an ``nn.Module``, an ``fmodel`` or a :class:`BatchedLoss`; ``names`` are
    parameter names as in ``model.named_parameters()`` (a tied parameter under its first name;
    every module that reads it — e.g. GPT-2's ``wte`` and ``lm_head`` — becomes a use).
    A rule whose operator is outside the clipping proof (see :mod:`._trust`) is used only when
    ``trusted`` (or ``OPAKE_TRUSTED_RULES``) names it.
    """
    module = getattr(model, "module", model)
    wanted = list(names)
    canonical = {id(p): n for n, p in module.named_parameters()}
    wanted_set = set(wanted)
    unsupported: list[tuple[str, str]] = [
        (n, "not a parameter of the model (names must come from make_functional)")
        for n in wanted
        if n not in set(canonical.values())
    ]
    layers: list[LayerRule] = []
    seen: set[int] = set()
    rules = registered_rules()
    skipped = untrusted(rules, trusted_names(trusted))
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if id(mod) in seen:
            continue
        params = tuple(
            (attr, canonical[id(p)])
            for attr, p in mod._parameters.items()
            if p is not None and canonical.get(id(p)) in wanted_set
        )
        if not params:
            continue
        seen.add(id(mod))
        rule, why = rule_for(mod, frozenset(attr for attr, _ in params), rules, skipped)
        if rule is None:
            unsupported.append((mod_name or "<root>", why))
        else:
            layers.append(LayerRule(mod_name, rule.name, params, rule))
    return BookkeepingPlan(tuple(layers), tuple(unsupported))
