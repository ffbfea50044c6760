"""The family-side contract: what ``ModelFamily.apply`` receives and must return.

``apply_model_patches`` finds the family of ``model.config.model_type`` through the plugin
manager and calls ``family.apply(model, options)``:

* ``model`` — the Hugging Face model *instance* (a PEFT wrapper is already unwrapped: this is
  ``peft_model.get_base_model()``);
* ``options`` — a frozen :class:`~opake.patches.PatchOptions`.

The family patches that instance only (never a class), honouring ``options.performance`` and
``options.kernels`` (:meth:`PatchOptions.kernel_for`), fails closed on a model whose structure
it does not recognise (raise :class:`~opake.core.errors.ConfigurationError`; partial changes must
be undone first), and returns a :class:`FamilyPatch`. The dispatcher then applies the shared
pieces the family *describes* in ``FamilyPatch.hf`` (the 2-D → 4-D mask conversion and the
loss-only forward), so a family never installs those itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, runtime_checkable

from opake.core.errors import ConfigurationError, InputTypeError
from opake.patches._patcher import Patcher
from opake.patches.hf._loss_only import LossOnlyHead
from opake.patches.hf._mask import ATTENTION_KINDS

if TYPE_CHECKING:
    from opake.patches.model._options import PatchOptions

__all__ = ["FamilyApply", "FamilyPatch", "FamilyResult", "HFCompat"]


@dataclass(frozen=True)
class HFCompat:
    """What the dispatcher needs to know to apply the shared HF pieces to one model.

    Attributes:
        attention: ``"causal"`` (decoders) or ``"bidirectional"`` (encoders): how a 2-D
            ``attention_mask`` is expanded into the 4-D float additive mask; None leaves masks
            alone.
        head: where the causal-LM head is and how its logits are transformed; None when the
            model has no vocabulary projection (classifiers, encoders) — no loss-only forward.

    Example:
        >>> HFCompat("causal", LossOnlyHead(logit_scale=0.5)).head.logit_scale
        0.5
    """

    attention: Literal["causal", "bidirectional"] | None = "causal"
    head: LossOnlyHead | None = None

    def __post_init__(self) -> None:
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise ConfigurationError(
                f"HFCompat(attention={self.attention!r}): expected one of {ATTENTION_KINDS} or "
                "None."
            )
        if self.head is not None and not isinstance(self.head, LossOnlyHead):
            raise InputTypeError(f"HFCompat(head={self.head!r}): expected a LossOnlyHead or None.")


@runtime_checkable
class FamilyPatch(Protocol):
    """What a family's ``apply`` returns: the handle that undoes its changes.

    Required: ``undo()`` — restore the instance exactly as it was (idempotent; the dispatcher
    calls it on :func:`~opake.patches.remove_model_patches` and when a later step fails).

    Optional attributes, read with ``getattr`` when present (an existing report class only
    needs ``undo``):

    * ``applied: Sequence[str]`` — one line per change (``"rms_norm: 5 LlamaRMSNorm modules"``);
    * ``kernels: Mapping[str, tuple[str, str]]`` — op → ``(backend, reason)``;
    * ``skipped: Mapping[str, str]`` — part → why it was not applied;
    * ``hf: HFCompat | None`` — the shared pieces the dispatcher should apply.
    """

    def undo(self) -> None:
        """Restore the model instance (idempotent)."""


class FamilyApply(Protocol):
    """The signature of ``ModelFamily.apply`` (the contract family authors implement).

    ``apply(model, options) -> FamilyPatch``:

    1. ``model`` is the unwrapped HF model instance; ``options`` a frozen
       :class:`~opake.patches.PatchOptions` (``performance``, ``compat``, ``kernels``,
       ``device_type``, the resolved ``loss_kernel`` ...).
    2. Check the structure you rely on; raise ``ConfigurationError`` (after undoing anything
       you changed) when it does not match — never patch a model you do not recognise.
    3. Patch the instance only, recording every change so it can be undone. Use
       ``options.kernel_for(op)`` for each kernel you would swap in (``(False, None)`` means
       leave it; a backend name is explicit and must raise if it cannot run).
    4. Return a :class:`FamilyPatch` (e.g. :class:`FamilyResult`) whose ``hf`` describes the
       attention kind and the causal-LM head; do not install the mask conversion or the
       loss-only forward yourself — the dispatcher does, after your ``apply`` returns, so the
       whole set is all-or-nothing and in one report.

    Calling ``apply`` twice on the same instance never happens: the dispatcher keeps one patch
    set per model and refuses to stack a second one.
    """

    def __call__(self, model: Any, options: PatchOptions) -> FamilyPatch:
        """Patch *model* as described above."""
        ...


@dataclass
class FamilyResult:
    """A ready-made :class:`FamilyPatch` for families without their own report class.

    Record changes through ``patcher`` (a :class:`~opake.patches.Patcher`); ``undo`` replays
    them backwards.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> result = FamilyResult(hf=HFCompat("causal"))
        >>> result.patcher.set_attr(lin, "forward", lambda x: x)
        >>> result.applied.append("identity forward")
        >>> result.undo(); "forward" in vars(lin)
        False
    """

    patcher: Patcher = field(default_factory=Patcher)
    applied: list[str] = field(default_factory=list)
    kernels: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    hf: HFCompat | None = None

    def undo(self) -> None:
        """Undo every change recorded in :attr:`patcher` (idempotent)."""
        self.patcher.undo()


class FamilyFields(TypedDict):
    """A :class:`FamilyPatch`'s report fields, as :func:`read_family_patch` reads them."""

    applied: list[str]
    kernels: dict[str, tuple[str, str]]
    skipped: dict[str, str]
    hf: HFCompat | None


def read_family_patch(result: object, family: str) -> FamilyFields:
    """Check a family's return value and read its optional report fields."""
    if not callable(getattr(result, "undo", None)):
        raise InputTypeError(
            f"model family {family!r}: apply() returned {type(result).__name__}, expected an "
            "object with an undo() method (a FamilyPatch, e.g. opake.patches.FamilyResult)."
        )
    applied = getattr(result, "applied", ()) or ()
    kernels = getattr(result, "kernels", {}) or {}
    skipped = getattr(result, "skipped", {}) or {}
    hf = getattr(result, "hf", None)
    if isinstance(applied, str) or not isinstance(applied, Sequence):
        raise InputTypeError(f"model family {family!r}: FamilyPatch.applied must be a list of str.")
    if not isinstance(kernels, Mapping) or not isinstance(skipped, Mapping):
        raise InputTypeError(
            f"model family {family!r}: FamilyPatch.kernels and .skipped must be mappings."
        )
    if hf is not None and not isinstance(hf, HFCompat):
        raise InputTypeError(
            f"model family {family!r}: FamilyPatch.hf must be an opake.patches.HFCompat or None, "
            f"got {type(hf).__name__}."
        )
    return {
        "applied": [str(a) for a in applied],
        "kernels": {str(op): (str(v[0]), str(v[1])) for op, v in kernels.items()},
        "skipped": {str(k): str(v) for k, v in skipped.items()},
        "hf": hf,
    }
