"""Clipping methods and their states (frozen, serialisable dataclasses).

Each class is both the configuration a user passes as ``clipped_grad(clipping_norm=...)`` and the
state ``grad_fn`` threads through training steps. Only :class:`AdaptiveClipping` changes from
step to step; the others are returned unchanged. Every class derives from :class:`ClipState`
and computes its own per-example factors (:meth:`ClipState.factors`); see ``README.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from opake.core.errors import ConfigurationError, InputTypeError, suggest
from opake.dpsgd.clipping import _base
from opake.dpsgd.clipping._adaptive import (
    AdaptiveClipping,
    AdaptiveNoiseSplit,
    adaptive_noise_split,
    gradient_noise_multiplier,
)
from opake.dpsgd.clipping._base import (
    EPS,
    KINDS,
    ChunkNorms,
    ClipFactors,
    ClipState,
    GroupSpec,
    check_keys,
    positive,
    whole_gradient_factors,
)

__all__ = [
    "AdaptiveClipping",
    "AdaptiveNoiseSplit",
    "AutoSClipping",
    "ClipState",
    "FixedClipping",
    "GroupClipping",
    "adaptive_noise_split",
    "assign_groups",
    "clip_state_from_dict",
    "gradient_noise_multiplier",
]


@dataclass(frozen=True)
class FixedClipping(ClipState):
    """Clip every example's gradient to L2 norm ``clipping_norm`` (C); sensitivity C.

    Each example's gradient ``g`` (all differentiated leaves together) is scaled by
    ``min(1, C / (‖g‖ + 1e-6))``.

    >>> FixedClipping(1.0).sensitivity
    1.0
    >>> FixedClipping.from_dict(FixedClipping(0.5).to_dict())
    FixedClipping(clipping_norm=0.5)
    """

    kind: ClassVar[str] = "fixed"
    clipping_norm: float

    def __post_init__(self) -> None:
        norm = positive("FixedClipping", "clipping_norm", self.clipping_norm)
        object.__setattr__(self, "clipping_norm", norm)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum (before ``normalize_by``): C."""
        return self.clipping_norm

    def factors(self, norms: ChunkNorms) -> ClipFactors:
        """``min(1, C / (‖g‖ + 1e-6))`` for each example's whole gradient."""
        factor = (self.clipping_norm / (norms.bound + EPS)).clamp(max=1.0)
        return whole_gradient_factors(norms, factor)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norm": self.clipping_norm}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedClipping:
        """Rebuild from :meth:`to_dict` output."""
        check_keys("FixedClipping.from_dict", data, {"clipping_norm"}, set())
        return cls(data["clipping_norm"])


@dataclass(frozen=True)
class GroupClipping(ClipState):
    """Clip each parameter group separately: group k of an example's gradient to norm ``C_k``.

    The clipped per-example gradient then has norm at most ``sqrt(Σ_k C_k²)``, the combined
    sensitivity. Which parameters form a group is decided by ``clipped_grad(clipping_groups=...)``
    (by default a group name is a dotted prefix of parameter names; ``""`` matches every name).

    >>> state = GroupClipping({"encoder": 3.0, "head": 4.0})
    >>> state.sensitivity
    5.0
    >>> GroupClipping.from_dict(state.to_dict()) == state
    True
    """

    kind: ClassVar[str] = "group"
    clipping_norms: Mapping[str, float]

    def __post_init__(self) -> None:
        if not isinstance(self.clipping_norms, Mapping) or not self.clipping_norms:
            raise ConfigurationError(
                f"GroupClipping: clipping_norms={self.clipping_norms!r}; expected a non-empty "
                "mapping from group name to a positive float bound"
            )
        norms: dict[str, float] = {}
        for name, value in self.clipping_norms.items():
            if not isinstance(name, str):
                raise InputTypeError(
                    f"GroupClipping: group name {name!r} is a {type(name).__name__}; expected str"
                )
            norms[name] = positive("GroupClipping", f"clipping_norms[{name!r}]", value)
        object.__setattr__(self, "clipping_norms", MappingProxyType(norms))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupClipping):
            return NotImplemented
        return dict(self.clipping_norms) == dict(other.clipping_norms)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.clipping_norms.items())))

    def __repr__(self) -> str:
        return f"GroupClipping(clipping_norms={dict(self.clipping_norms)!r})"

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum: ``sqrt(Σ_k C_k²)``."""
        return math.sqrt(math.fsum(c * c for c in self.clipping_norms.values()))

    def group_names(self) -> tuple[str, ...]:
        """The groups, in the order of :attr:`ClipFactors.group_norms`'s columns."""
        return tuple(self.clipping_norms)

    def leaf_groups(self, names: tuple[str, ...], spec: GroupSpec) -> tuple[int, ...]:
        """The group of each differentiated leaf; every leaf needs one, every group a leaf."""
        return assign_groups(names, self.group_names(), spec)

    def factors(self, norms: ChunkNorms) -> ClipFactors:
        """``min(1, C_k / (‖g_k‖ + 1e-6))`` for group ``k`` of each example's gradient."""
        import torch

        if norms.groups is None:
            raise ConfigurationError("GroupClipping.factors: the chunk carries no leaf groups")
        device = norms.leaf_sq.device
        index = torch.tensor(norms.groups, device=device)
        m, k = norms.leaf_sq.shape[0], len(self.clipping_norms)
        empty = torch.zeros(m, k, dtype=torch.float64, device=device)
        per_group = empty.index_add(1, index, norms.leaf_sq).sqrt()
        group_bound = empty.index_add(1, index, norms.bound_sq).sqrt()
        bounds = torch.tensor(
            list(self.clipping_norms.values()), dtype=torch.float64, device=device
        )
        contributes = norms.contributes
        factor = (bounds / (group_bound + EPS)).clamp(max=1.0)
        factor = torch.where(contributes[:, None], factor, 0.0)
        after = (per_group * factor).square().sum(dim=1).sqrt()
        return ClipFactors(
            leaf_factor=_base._fp32_toward_zero(factor)[:, index],
            contributes=contributes,
            clipped_norms=torch.where(contributes, after, 0.0),
            shrunk=(factor < 1.0).any(dim=1),
            group_norms=per_group,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norms": dict(self.clipping_norms)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupClipping:
        """Rebuild from :meth:`to_dict` output."""
        check_keys("GroupClipping.from_dict", data, {"clipping_norms"}, set())
        return cls(dict(data["clipping_norms"]))


@dataclass(frozen=True)
class AutoSClipping(ClipState):
    """Automatic clipping AUTO-S (Bu et al., 2023): scale each gradient by ``R / (‖g‖ + γ)``.

    Every example is rescaled (there is no threshold to tune); its norm becomes
    ``R‖g‖/(‖g‖+γ) < R``, so the sensitivity is ``R`` (``clipping_norm``). ``stability`` is γ.

    >>> AutoSClipping(clipping_norm=1.0, stability=0.01).sensitivity
    1.0
    """

    kind: ClassVar[str] = "auto_s"
    clipping_norm: float = 1.0
    stability: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "clipping_norm", positive("AutoSClipping", "clipping_norm", self.clipping_norm)
        )
        object.__setattr__(
            self, "stability", positive("AutoSClipping", "stability", self.stability)
        )

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the rescaled sum: R."""
        return self.clipping_norm

    def factors(self, norms: ChunkNorms) -> ClipFactors:
        """``R / (‖g‖ + γ)`` for each example's whole gradient (every example rescaled)."""
        return whole_gradient_factors(norms, self.clipping_norm / (norms.bound + self.stability))

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norm": self.clipping_norm, "stability": self.stability}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoSClipping:
        """Rebuild from :meth:`to_dict` output."""
        check_keys("AutoSClipping.from_dict", data, {"clipping_norm", "stability"}, set())
        return cls(data["clipping_norm"], data["stability"])


def clip_state_from_dict(data: Mapping[str, Any]) -> ClipState:
    """Rebuild any clip state from its ``to_dict()`` form (dispatch on ``data["kind"]``).

    >>> clip_state_from_dict(AutoSClipping(2.0).to_dict())
    AutoSClipping(clipping_norm=2.0, stability=0.01)
    """
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind not in KINDS:
        raise ConfigurationError(
            f"clip_state_from_dict: kind={kind!r}; expected one of {sorted(KINDS)} (a dict "
            "produced by a clip state's to_dict())"
        )
    return KINDS[kind].from_dict(data)


def assign_groups(
    names: tuple[str, ...], group_names: tuple[str, ...], spec: GroupSpec
) -> tuple[int, ...]:
    """Group index of each leaf: by ``spec`` (mapping or callable), else the longest group name
    that is a dotted prefix of the leaf's name (``""`` matches every name)."""
    index = {g: i for i, g in enumerate(group_names)}
    assigned: list[int] = []
    unassigned: list[str] = []
    for name in names:
        if spec is None:
            matches = [g for g in group_names if g in {"", name} or name.startswith(g + ".")]
            group = max(matches, key=len) if matches else None
        elif isinstance(spec, Mapping):
            group = spec.get(name)
        else:
            group = spec(name)
        if group is None:
            unassigned.append(name)
            continue
        if group not in index:
            raise ConfigurationError(
                f"group clipping: parameter {name!r} is assigned to group {group!r}, which "
                f"has no bound in clipping_norm (groups: {list(group_names)})"
                f"{suggest(str(group), group_names)}"
            )
        assigned.append(index[group])
    if unassigned:
        raise ConfigurationError(
            f"group clipping: parameter(s) {unassigned[:5]} belong to no group of "
            f"{list(group_names)}; every differentiated parameter needs a bound (add a "
            "catch-all group '' or map them in clipping_groups)"
        )
    unused = [g for g, i in index.items() if i not in assigned]
    if unused:
        raise ConfigurationError(
            f"group clipping: group(s) {unused} match no differentiated parameter; remove "
            "them (they would inflate the sensitivity) or fix the group names"
        )
    return tuple(assigned)
