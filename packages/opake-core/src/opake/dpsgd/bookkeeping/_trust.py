"""Which book-keeping rules and operators are inside the clipping proof, and the trust list.

A rule whose pieces are :class:`~._pieces.OuterSum` or :class:`~._pieces.Dense` is always inside
the proof: the engine computes the norm and the sum from the same recorded tensors, whatever
the rule does. A rule with :class:`~._pieces.Implicit` pieces hands both to an operator; that is
inside the proof only for Opake's own distributions (whose operators certify their bounds and
are tested against the exact oracle). Any other such rule is used only when the user names it:
``clipped_grad(trusted_rules=("my-rule",))`` or the environment variable
:data:`TRUST_ENV` (comma-separated names); otherwise its layers go to the per-layer vmap rule,
with the reason logged on ``opake.core``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from opake.core.errors import InputTypeError

__all__ = ["FIRST_PARTY", "TRUST_ENV", "implicit_outside_proof", "trusted_names"]

#: comma-separated names of rules (or operator classes) outside the proof that the user trusts
TRUST_ENV = "OPAKE_TRUSTED_RULES"

#: Opake's own distributions: their rules' operators are part of the proof
FIRST_PARTY = frozenset(
    {
        "opake",
        "opake-core",
        "opake-patches",
        "opake-kernels",
        "opake-profiling",
        "opake-models",
        "opake-auditing",
        "opake-transformers",
    }
)


def trusted_names(explicit: Iterable[str] = ()) -> frozenset[str]:
    """The trust list: ``explicit`` names plus those of :data:`TRUST_ENV`.

    >>> sorted(trusted_names(["my-rule"]))
    ['my-rule']
    """
    if isinstance(explicit, str) or not all(isinstance(n, str) for n in explicit):
        raise InputTypeError(
            f"trusted_rules={explicit!r}: expected a tuple of rule (or operator class) names, "
            'e.g. trusted_rules=("my-rule",)'
        )
    env = os.environ.get(TRUST_ENV, "")
    return frozenset(explicit) | {n.strip() for n in env.split(",") if n.strip()}


def implicit_outside_proof(kinds: Iterable[str], origin: str | None, builtin: bool) -> bool:
    """Whether a rule producing pieces of ``kinds``, registered by distribution ``origin``
    (``builtin``: opake-core's own), is outside the proof.

    >>> implicit_outside_proof(["dense"], None, False)
    False
    >>> implicit_outside_proof(["implicit"], "my-plugin-dist", False)
    True
    """
    if "implicit" not in set(kinds):
        return False
    return not builtin and origin not in FIRST_PARTY
