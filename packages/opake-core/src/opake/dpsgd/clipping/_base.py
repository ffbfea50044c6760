"""The clipping-method protocol: what a clip state receives per chunk and what it returns.

A clipping method is one class deriving from :class:`ClipState` (see ``README.md`` beside this
module, "add a clipping method"). For every chunk of examples the orchestration hands it a
:class:`ChunkNorms` (per-example, per-leaf squared norms from the engine) and gets back a
:class:`ClipFactors` (the fp32 factor of every example and leaf, the clipped norms and what the
state needs to carry over, e.g. adaptive clipping's count). The engine then adds
``Σ_i factor[i, j] · g_ij`` for each leaf ``j``. Nothing here knows which engine ran.
"""

from __future__ import annotations

import abc
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, overload

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "ChunkNorms", "ClipFactors", "ClipState", "whole_gradient_factors"]

EPS = 1e-6  # added to the norm before dividing (as Opacus does): keeps C/(‖g‖+ε) finite

#: kind → clip-state class, filled by :meth:`ClipState.__init_subclass__`
KINDS: dict[str, type[ClipState]] = {}

GroupSpec = Mapping[str, str] | Callable[[str], str] | None
_T = TypeVar("_T")


class _once(Generic[_T]):  # noqa: N801 - used as a decorator, like functools.cached_property
    """A lazily computed attribute kept in the instance's ``__dict__`` (frozen dataclasses too).

    :func:`functools.cached_property` without its lock (Python 3.11 takes an ``RLock``, which
    ``torch.compile`` cannot trace). ``ChunkNorms`` is never shared between threads.
    """

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> _once[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _T: ...
    def __get__(self, obj: object, owner: type) -> _T | _once[_T]:
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


def _fp32_toward_zero(factor: torch.Tensor) -> torch.Tensor:
    """Cast fp64 clipping factors to fp32, rounding toward zero (never enlarging a gradient).

    Round-to-nearest could raise a factor by half an ulp — for a subnormal factor (a gradient
    norm ~1e38 clipped to C ~0.1) that is several parts per million, enough to break
    ``‖clipped‖ ≤ C``. Rounding down keeps ``‖g‖ · factor₃₂ ≤ ‖g‖ · factor ≤ C``.
    """
    import torch

    rounded = factor.to(torch.float32)
    too_big = rounded.double() > factor
    return torch.where(too_big, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


@dataclass(frozen=True)
class ChunkNorms:
    """What a clip state sees of one chunk of ``m`` examples (all fp64 but the masks).

    Attributes:
        leaf_sq: ``[m, leaves]`` squared norms of each example's gradient per leaf (reported).
        bound_sq: ``[m, leaves]`` squared norms to clip with: upper bounds of what each example
            adds to each leaf (equal to ``leaf_sq`` for the vmap engine; certified bounds for
            book-keeping).
        is_real: ``[m]`` bool, ``False`` for padding rows (they must get factor 0).
        groups: leaf → group index, from :meth:`ClipState.leaf_groups` (``None``: no groups).
    """

    leaf_sq: torch.Tensor
    bound_sq: torch.Tensor
    is_real: torch.Tensor
    groups: tuple[int, ...] | None = None

    @_once
    def total(self) -> torch.Tensor:
        """``[m]`` reported per-example norms (all leaves together)."""
        return self.leaf_sq.sum(dim=1).sqrt()

    @_once
    def bound(self) -> torch.Tensor:
        """``[m]`` per-example norms to clip with."""
        return self.bound_sq.sum(dim=1).sqrt()

    @_once
    def finite(self) -> torch.Tensor:
        """``[m]`` bool: both norms finite (a non-finite example contributes zero)."""
        import torch

        return torch.isfinite(self.total) & torch.isfinite(self.bound)

    @_once
    def contributes(self) -> torch.Tensor:
        """``[m]`` bool: a real example with a finite gradient."""
        return self.finite & self.is_real


@dataclass(frozen=True)
class ClipFactors:
    """What a clip state returns for one chunk.

    Attributes:
        leaf_factor: ``[m, leaves]`` fp32 factors, rounded toward zero, 0 where an example does
            not contribute; the engine adds ``Σ_i leaf_factor[i, j] · g_ij`` to leaf ``j``.
        contributes: ``[m]`` bool (as :attr:`ChunkNorms.contributes`).
        clipped_norms: ``[m]`` fp64 norms after clipping (0 where nothing is added).
        shrunk: ``[m]`` bool, the example's gradient was scaled down (the clipping rate).
        group_norms: ``[m, groups]`` fp64 per-group norms before clipping, or ``None``.
        count: a 0-d fp64 tensor the state accumulates over the call (adaptive clipping's
            centred count), or ``None``.
    """

    leaf_factor: torch.Tensor
    contributes: torch.Tensor
    clipped_norms: torch.Tensor
    shrunk: torch.Tensor
    group_norms: torch.Tensor | None = None
    count: torch.Tensor | None = None


def whole_gradient_factors(
    norms: ChunkNorms, factor: torch.Tensor, *, count: torch.Tensor | None = None
) -> ClipFactors:
    """:class:`ClipFactors` for a method that scales an example's whole gradient by ``factor``.

    ``factor`` is ``[m]`` fp64, computed from :attr:`ChunkNorms.bound`; rows that do not
    contribute get 0 here, whatever ``factor`` says.
    """
    import torch

    contributes = norms.contributes
    factor = torch.where(contributes, factor, 0.0)
    m, leaves = norms.leaf_sq.shape
    return ClipFactors(
        leaf_factor=_fp32_toward_zero(factor)[:, None].expand(m, leaves),
        contributes=contributes,
        clipped_norms=torch.where(contributes, norms.total * factor, 0.0),
        shrunk=factor < 1.0,
        count=count,
    )


def _source(cls: type) -> str | None:
    module = sys.modules.get(cls.__module__)
    return getattr(module, "__file__", None) or cls.__module__


class ClipState(abc.ABC):
    """Base class of every clipping method (each a frozen, serialisable dataclass).

    A subclass declares ``kind`` (its name in :meth:`to_dict`; registered for
    :func:`~opake.dpsgd.clipping.clip_state_from_dict`) and implements :attr:`sensitivity`,
    :meth:`factors`, :meth:`to_dict` and :meth:`from_dict`. Optional: :meth:`leaf_groups`
    (per-group methods), :meth:`advance` (methods that change from step to step, naming the
    :meth:`to_dict` keys that change in :attr:`evolving`),
    :attr:`count_noise_multiplier` (methods that release a noisy statistic of their own).
    """

    kind: ClassVar[str]
    #: keys of :meth:`to_dict` that change from step to step (a resumed training takes the
    #: saved values; every other key is a setting the resuming training must share)
    evolving: ClassVar[frozenset[str]] = frozenset()
    #: σ of a noisy count this method releases besides the gradient (``None``: none)
    count_noise_multiplier: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not isinstance(kind, str):
            return
        taken = KINDS.get(kind)
        if taken is None:
            KINDS[kind] = cls
        elif (_source(taken), taken.__qualname__) != (_source(cls), cls.__qualname__):
            raise ConfigurationError(
                f"clip state kind {kind!r} is taken by {taken.__qualname__}; give "
                f"{cls.__qualname__} another kind"
            )
        # the same class defined again (its module imported a second time): the first stays

    @property
    @abc.abstractmethod
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum (before ``normalize_by``)."""

    def leaf_groups(self, names: tuple[str, ...], spec: GroupSpec) -> tuple[int, ...] | None:
        """Leaf → group index for :attr:`ChunkNorms.groups` (``None``: the method has none)."""
        if spec is not None:
            raise ConfigurationError(
                "clipped_grad(clipping_groups=...) only applies to group clipping; pass "
                "clipping_norm as a mapping group → bound"
            )
        return None

    def group_names(self) -> tuple[str, ...] | None:
        """Names of the columns of :attr:`ClipFactors.group_norms` (``None``: no groups)."""
        return None

    @abc.abstractmethod
    def factors(self, norms: ChunkNorms) -> ClipFactors:
        """Per-example, per-leaf factors for one chunk (see :class:`ClipFactors`)."""

    def advance(self, count: torch.Tensor, *, end_step: bool) -> ClipState:
        """The state after one ``grad_fn`` call; ``count`` sums :attr:`ClipFactors.count`."""
        return self

    def end_step(
        self,
        *,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        unit_noise: float | None = None,
    ) -> ClipState:
        """End a logical step (``reduce``: e.g. an all-reduce of a pending count across ranks;
        ``unit_noise``: a standard normal value drawn by the caller for a step's own noise, see
        ``DPOptimizer.count_noise``); a method without step-to-step state returns ``self``."""
        return self

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""

    @classmethod
    @abc.abstractmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClipState:
        """Rebuild from :meth:`to_dict` output."""


def positive(owner: str, name: str, value: object, *, allow_inf: bool = False) -> float:
    """``value`` as a positive (finite unless ``allow_inf``) float, or a typed error."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(
            f"{owner}: {name}={value!r} is a {type(value).__name__}; expected a positive float"
        )
    value = float(value)
    if not (value > 0.0) or (math.isinf(value) and not allow_inf):
        raise ConfigurationError(
            f"{owner}: {name}={value!r}; expected a positive finite float (a clipping bound "
            "must be finite for the sensitivity, and so the privacy guarantee, to exist)"
        )
    return value


def check_keys(owner: str, data: Mapping[str, Any], required: set[str], optional: set[str]) -> None:
    """Check a ``to_dict()`` mapping has exactly the expected keys."""
    if not isinstance(data, Mapping):
        raise InputTypeError(f"{owner}: expected a mapping (from to_dict()), got {type(data)}")
    missing = required - set(data)
    unknown = set(data) - required - optional - {"kind"}
    if missing or unknown:
        raise ConfigurationError(
            f"{owner}: missing keys {sorted(missing)} / unknown keys {sorted(unknown)}; pass a "
            "dict produced by to_dict() of the same class"
        )
