"""Frozen, validated descriptors that plugins return from their hooks."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opake.core._dotted import is_dotted_path, resolve_dotted
from opake.core.errors import ConfigurationError, InputTypeError

__all__ = ["KNOWN_DEVICES", "PIECE_KINDS", "BookkeepingRule", "KernelBackend", "ModelFamily"]

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_MODEL_TYPE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")
#: device types a kernel backend may declare
KNOWN_DEVICES: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu", "meta")
#: the per-example gradient pieces a book-keeping rule may produce (``opake.dpsgd.bookkeeping``:
#: ``OuterSum``, ``Dense``, ``Implicit``)
PIECE_KINDS: tuple[str, ...] = ("outer", "dense", "implicit")


def _check_name(kind: str, name: object) -> str:
    if not isinstance(name, str):
        raise InputTypeError(f"{kind} name must be a str, got {type(name).__name__}: {name!r}.")
    if not _NAME.match(name):
        raise ConfigurationError(
            f"{kind} name {name!r} is invalid: use lowercase letters, digits, '_' or '-', "
            "starting with a letter (e.g. 'llama', 'my-backend')."
        )
    return name


def _check_callable_or_path(kind: str, what: str, value: object) -> None:
    if callable(value):
        return
    if isinstance(value, str):
        if is_dotted_path(value):
            return
        raise ConfigurationError(
            f"{kind}: {what}={value!r} is neither callable nor a dotted path; "
            "give a function or 'package.module:function'."
        )
    raise InputTypeError(
        f"{kind}: {what} must be a callable or a dotted path string, got {type(value).__name__}."
    )


def _resolve(value: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
    obj = resolve_dotted(value) if isinstance(value, str) else value
    if not callable(obj):
        raise ConfigurationError(f"{what} resolved to {obj!r}, which is not callable.")
    return obj


@dataclass(frozen=True)
class ModelFamily:
    """A family of Hugging Face models that ``apply_model_patches`` knows how to patch.

    Args:
        name: unique family name (``"llama"``).
        model_types: the ``config.model_type`` values it handles (``("llama", "mistral")``).
        apply: ``apply(model, options) -> report``, or a dotted path to it, imported only
            when a model of this family is patched.
        requires: optional requirement string (``"transformers>=5.17,<6"``) naming the library
            versions the family targets; out of range, the family is skipped, not crashed.

    Example:
        >>> fam = ModelFamily("toy", ("toy",), apply="builtins:print")
        >>> fam.name, fam.model_types
        ('toy', ('toy',))
    """

    name: str
    model_types: tuple[str, ...]
    apply: Callable[..., Any] | str
    requires: str | None = None

    def __post_init__(self) -> None:
        _check_name("ModelFamily", self.name)
        types = self.model_types
        if isinstance(types, str):
            raise InputTypeError(
                f"ModelFamily {self.name!r}: model_types must be a tuple of strings, got the "
                f"single string {types!r}; write ({types!r},)."
            )
        if not isinstance(types, (tuple, list)):
            raise InputTypeError(
                f"ModelFamily {self.name!r}: model_types must be a tuple of strings, "
                f"got {type(types).__name__}."
            )
        types = tuple(types)
        if not types:
            raise ConfigurationError(
                f"ModelFamily {self.name!r}: model_types is empty; name at least one HF "
                "config.model_type."
            )
        for t in types:
            if not isinstance(t, str) or not _MODEL_TYPE.match(t):
                raise ConfigurationError(
                    f"ModelFamily {self.name!r}: model type {t!r} is invalid; HF model types "
                    "are lowercase strings such as 'llama' or 'gpt_neox'."
                )
        if len(set(types)) != len(types):
            raise ConfigurationError(
                f"ModelFamily {self.name!r}: model_types {types!r} has duplicates."
            )
        object.__setattr__(self, "model_types", types)
        _check_callable_or_path(f"ModelFamily {self.name!r}", "apply", self.apply)
        if self.requires is not None:
            from packaging.requirements import InvalidRequirement, Requirement

            try:
                Requirement(self.requires)
            except InvalidRequirement as err:
                raise ConfigurationError(
                    f"ModelFamily {self.name!r}: requires={self.requires!r} is not a valid "
                    f"requirement string ({err}); write e.g. 'transformers>=5.17,<6'."
                ) from err

    def load_apply(self) -> Callable[..., Any]:
        """Return the ``apply`` callable, importing it if it was given as a dotted path."""
        return _resolve(self.apply, f"ModelFamily {self.name!r} apply")

    def supported(self) -> tuple[bool, str]:
        """Check ``requires`` against the installed versions: ``(ok, reason)``."""
        if self.requires is None:
            return True, "no version requirement"
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement

        req = Requirement(self.requires)
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            return False, f"{req.name} is not installed (family requires {self.requires})"
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            return False, f"{req.name} {installed} is outside {self.requires}"
        return True, f"{req.name} {installed} satisfies {self.requires}"


@dataclass(frozen=True)
class KernelBackend:
    """A set of kernel implementations (ops) for some devices.

    Args:
        name: unique backend name (``"torch"``, ``"chunked"``, ``"triton"``).
        ops: op name -> implementation (callable or dotted path, imported only when chosen).
        devices: device types the backend runs on (``("cpu", "cuda")``).
        priority: higher wins automatic selection among available backends.
        available: optional zero-argument check (e.g. "a GPU and Triton are present").

    Example:
        >>> be = KernelBackend("toy", {"rms_norm": "math:hypot"}, devices=("cpu",))
        >>> be.supports("rms_norm", "cpu"), be.supports("rms_norm", "cuda")
        (True, False)
    """

    name: str
    ops: Mapping[str, Callable[..., Any] | str]
    devices: tuple[str, ...]
    priority: int = 0
    available: Callable[[], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_name("KernelBackend", self.name)
        if not isinstance(self.ops, Mapping):
            raise InputTypeError(
                f"KernelBackend {self.name!r}: ops must be a mapping of op name to callable "
                f"or dotted path, got {type(self.ops).__name__}."
            )
        if not self.ops:
            raise ConfigurationError(f"KernelBackend {self.name!r}: ops is empty.")
        for op, impl in self.ops.items():
            if not isinstance(op, str) or not _NAME.match(op):
                raise ConfigurationError(f"KernelBackend {self.name!r}: op name {op!r} invalid.")
            _check_callable_or_path(f"KernelBackend {self.name!r}", f"ops[{op!r}]", impl)
        object.__setattr__(self, "ops", MappingProxyType(dict(self.ops)))
        devices = self.devices
        if isinstance(devices, str) or not isinstance(devices, (tuple, list)):
            raise InputTypeError(
                f"KernelBackend {self.name!r}: devices must be a tuple of device types "
                f"such as ('cpu', 'cuda'), got {devices!r}."
            )
        devices = tuple(devices)
        if not devices:
            raise ConfigurationError(f"KernelBackend {self.name!r}: devices is empty.")
        for d in devices:
            if d not in KNOWN_DEVICES:
                raise ConfigurationError(
                    f"KernelBackend {self.name!r}: unknown device type {d!r}; "
                    f"expected one of {KNOWN_DEVICES}."
                )
        object.__setattr__(self, "devices", devices)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InputTypeError(f"KernelBackend {self.name!r}: priority must be an int.")
        if self.available is not None and not callable(self.available):
            raise InputTypeError(
                f"KernelBackend {self.name!r}: available must be a zero-argument callable."
            )

    def is_available(self) -> bool:
        """Run the ``available`` check (True when there is none; False if it raises)."""
        if self.available is None:
            return True
        try:
            return bool(self.available())
        except Exception:
            return False

    def supports(self, op: str, device_type: str) -> bool:
        """True if the backend implements *op* and declares *device_type*."""
        return op in self.ops and device_type in self.devices

    def load_op(self, op: str) -> Callable[..., Any]:
        """Return the implementation of *op*, importing it if given as a dotted path."""
        if op not in self.ops:
            raise ConfigurationError(
                f"kernel backend {self.name!r} has no op {op!r}; it provides {sorted(self.ops)}."
            )
        return _resolve(self.ops[op], f"kernel backend {self.name!r} op {op!r}")


@dataclass(frozen=True)
class BookkeepingRule:
    """How the book-keeping engine gets the per-example gradients of one kind of layer.

    Args:
        name: unique rule name, shown by ``bookkeeping_plan(...)`` (``"linear"``).
        matches: ``matches(module, attrs) -> bool | str`` (or a dotted path to it): ``True``
            when the rule handles ``module`` whose differentiated parameter attributes are
            ``attrs`` (a ``frozenset``), ``False`` when the module is not its kind, or a
            string saying why a module of its kind cannot be handled (the engine then reports
            the layer unsupported: no later rule is tried).
        pieces: ``pieces(use) -> {attr: piece}`` (or a dotted path): from a recorded
            ``opake.dpsgd.bookkeeping.LayerUse`` (inputs, output gradient) the per-example
            gradient piece of every differentiated attribute.
        produces: ``attr -> piece kind`` (one of :data:`PIECE_KINDS`); the key ``"*"`` stands
            for any attribute. A module with a differentiated attribute outside it never
            matches, and a piece of another kind raises.
        example: ``example() -> opake.dpsgd.bookkeeping.RuleExample`` (or a dotted path): a
            small module the rule handles and the inputs it takes; the generated conformance
            test runs every registered rule on it against a per-example autograd loop.
        priority: rules are tried from the highest priority down (built-in closed-form rules
            have 0, the per-layer fallback -100); give a rule that should win over a built-in
            one a positive priority.
        keeps_output: the engine keeps the layer's (detached) output for ``pieces``.
        broadcast: a first input of batch 1 in a larger batch (position ids) is expanded to
            the batch before recording (off for rules that take inputs as they are).
        eager: build the pieces in the backward, as soon as the layer's output gradient
            arrives, and release the recorded inputs, output and output gradient there instead
            of holding them until every layer's gradient is known. For closed-form rules whose
            ``pieces`` runs no autograd and returns less than it releases (the norm rules:
            ``[B, d]`` per-example gradients in place of two activation-sized tensors); a use
            of an eager rule must receive exactly one output gradient (else ``OperationError``).

    Example:
        >>> rule = BookkeepingRule(
        ...     "toy-scale",
        ...     matches="my_pkg.rules:matches",
        ...     pieces="my_pkg.rules:pieces",
        ...     produces={"weight": "dense"},
        ...     example="my_pkg.rules:example",
        ... )
        >>> rule.name, dict(rule.produces), rule.eager
        ('toy-scale', {'weight': 'dense'}, False)
    """

    name: str
    matches: Callable[..., Any] | str
    pieces: Callable[..., Any] | str
    produces: Mapping[str, str]
    example: Callable[..., Any] | str
    priority: int = 0
    keeps_output: bool = False
    broadcast: bool = True
    eager: bool = False

    def __post_init__(self) -> None:
        _check_name("BookkeepingRule", self.name)
        owner = f"BookkeepingRule {self.name!r}"
        for what in ("matches", "pieces", "example"):
            _check_callable_or_path(owner, what, getattr(self, what))
        if not isinstance(self.produces, Mapping) or not self.produces:
            raise InputTypeError(
                f"{owner}: produces must be a non-empty mapping of parameter attribute (or "
                f"'*') to a piece kind in {PIECE_KINDS}, got {self.produces!r}."
            )
        for attr, kind in self.produces.items():
            if not isinstance(attr, str) or not (attr == "*" or attr.isidentifier()):
                raise ConfigurationError(
                    f"{owner}: produces key {attr!r} is not a parameter attribute name or '*'."
                )
            if kind not in PIECE_KINDS:
                raise ConfigurationError(
                    f"{owner}: produces[{attr!r}]={kind!r}; expected one of {PIECE_KINDS}."
                )
        object.__setattr__(self, "produces", MappingProxyType(dict(self.produces)))
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InputTypeError(f"{owner}: priority must be an int, got {self.priority!r}.")
        for flag in ("keeps_output", "broadcast", "eager"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise InputTypeError(f"{owner}: {flag} must be a bool, got {value!r}.")

    def kind_of(self, attr: str) -> str | None:
        """The piece kind this rule produces for ``attr`` (None: the attribute is not its).

        >>> BookkeepingRule("r", "m:f", "m:g", {"*": "dense"}, "m:h").kind_of("scale")
        'dense'
        """
        return self.produces.get(attr, self.produces.get("*"))

    def load_matches(self) -> Callable[..., Any]:
        """The ``matches`` callable (imported if given as a dotted path)."""
        return _resolve(self.matches, f"BookkeepingRule {self.name!r} matches")

    def load_pieces(self) -> Callable[..., Any]:
        """The ``pieces`` callable (imported if given as a dotted path)."""
        return _resolve(self.pieces, f"BookkeepingRule {self.name!r} pieces")

    def load_example(self) -> Callable[..., Any]:
        """The ``example`` callable (imported if given as a dotted path)."""
        return _resolve(self.example, f"BookkeepingRule {self.name!r} example")
