"""Look up first-party family specs by name."""

from __future__ import annotations

import importlib

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._plugin import FAMILIES
from opake.models._spec import FamilySpec

__all__ = ["family_names", "family_spec"]


def family_names() -> tuple[str, ...]:
    """The names of opake-models' own families (each is module ``opake.models.<name>``).

    >>> family_names()[:3]
    ('llama', 'mistral', 'qwen2')
    """
    return tuple(FAMILIES)


def family_spec(name: str) -> FamilySpec:
    """The :class:`FamilySpec` of one of opake-models' families, by family name.

    >>> family_spec("gemma2").attention.layer_types
    True
    """
    if not isinstance(name, str):
        raise InputTypeError(f"family_spec(name): name must be a str, got {type(name).__name__}.")
    if name not in FAMILIES:
        raise ConfigurationError(
            f"family_spec({name!r}): opake-models has no family {name!r}; its families are "
            f"{', '.join(FAMILIES)}. Third-party families are found with "
            "opake.core.plugins.model_families()."
        )
    spec = importlib.import_module(f"opake.models.{name}").SPEC
    if not isinstance(spec, FamilySpec):  # pragma: no cover - guarded by the meta-test
        raise ConfigurationError(f"opake.models.{name}.SPEC is not a FamilySpec.")
    return spec
