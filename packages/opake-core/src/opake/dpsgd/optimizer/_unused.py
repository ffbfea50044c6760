"""The first-step report of trainable parameters that get no gradient (a diagnostic).

A parameter the optimizer holds but the loss never reaches is either a mistake (a layer left
trainable by accident: it would be moved by noise alone, every step) or expected (a PEFT LoRA
``A`` matrix on the first step, while its ``B`` partner is still zero). :class:`UnusedCheck`
looks at the clipped sums of the first logical step(s) once: a missing gradient entry is
structural and reported on the first step; an all-zero sum is reported on the first step that has
any non-zero gradient at all (an empty Poisson batch, or every example non-finite, makes every
sum zero: the check then waits). It reads the data of those steps, so it is a diagnostic and
not private; ``unused_params="error"`` turns the report into an :class:`OperationError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, OpakePrivacyWarning, OperationError

if TYPE_CHECKING:
    import torch

__all__ = ["UNUSED_MODES", "UnusedCheck", "lora_a_note"]

#: what ``DPOptimizer(unused_params=...)`` accepts
UNUSED_MODES = ("warn", "error")


class UnusedCheck:
    """The first-step check of one :class:`~opake.dpsgd.optimizer.DPOptimizer`.

    >>> import torch
    >>> check = UnusedCheck("error")
    >>> check.run({"w": torch.ones(2), "b": torch.ones(1)}, skipped=())
    >>> check.done, check.state()
    (True, [True, True])
    """

    __slots__ = ("_missing_checked", "_mode", "_zero_checked")

    def __init__(self, mode: str) -> None:
        if mode not in UNUSED_MODES:
            raise ConfigurationError(
                f"unused_params={mode!r}: expected one of {', '.join(UNUSED_MODES)}"
            )
        self._mode = mode
        self._missing_checked = False
        self._zero_checked = False

    @property
    def done(self) -> bool:
        """Whether both checks have concluded (nothing more is looked at)."""
        return self._missing_checked and self._zero_checked

    def run(self, sums: Mapping[str, torch.Tensor], skipped: tuple[str, ...]) -> None:
        """Check the step's clipped ``sums`` and the names that got no entry (``skipped``);
        warn, or raise :class:`OperationError` in ``"error"`` mode."""
        zero: tuple[str, ...] = ()
        conclusive = False
        if not self._zero_checked:
            nonzero = {name: bool(total.count_nonzero()) for name, total in sums.items()}
            conclusive = any(nonzero.values())
            zero = tuple(name for name, flag in nonzero.items() if not flag) if conclusive else ()
        message = unused_message(() if self._missing_checked else skipped, zero)
        if message is not None:
            if self._mode == "error":
                raise OperationError(message)
            warnings.warn(message, OpakePrivacyWarning, stacklevel=3)
        self._missing_checked = True
        self._zero_checked = self._zero_checked or conclusive

    def state(self) -> list[bool]:
        """What :meth:`load` restores (part of the optimizer's state dict)."""
        return [self._missing_checked, self._zero_checked]

    def load(self, checked: tuple[bool, bool]) -> None:
        """Restore :meth:`state` (validated by the optimizer's state check)."""
        self._missing_checked, self._zero_checked = checked


def _expected_lora_a(zero: tuple[str, ...], skipped: tuple[str, ...]) -> tuple[str, ...]:
    """The PEFT LoRA ``A`` matrices among ``zero`` whose ``B`` partner did get a gradient.

    PEFT starts every ``B`` at zero, so ``A``'s gradient (``Bᵀ`` times the output's) is exactly
    zero until ``B`` moves, while ``B``'s own gradient is not: such an ``A`` is used by the loss.
    (An ``A`` whose ``B`` got no gradient either belongs to an unused layer: still reported.)
    """
    return tuple(
        name
        for name in zero
        if ".lora_A." in name
        and name.replace(".lora_A.", ".lora_B.") not in zero
        and name.replace(".lora_A.", ".lora_B.") not in skipped
    )


def lora_a_note(names: Sequence[str]) -> str:
    """What the first step does to PEFT LoRA ``A`` matrices whose ``B`` partners start at zero
    (the words of the optimizer's report and of ``opake train``'s plan).

    >>> lora_a_note(["m.lora_A.default.weight"])[:52]
    '1 LoRA A matrices get no gradient on the first step '
    """
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (
        f"{len(names)} LoRA A matrices get no gradient on the first step (an all-zero gradient: "
        "their B partners start at zero), so that step moves them by noise alone; this is "
        f"expected and costs no privacy: {shown}"
    )


def unused_message(skipped: tuple[str, ...], zero: tuple[str, ...]) -> str | None:
    """The first-step report of parameters without gradient (``None``: nothing to report).

    LoRA ``A`` matrices whose ``B`` partners start at zero are reported as what they are:
    expected, and moved by noise alone on that step, which costs no privacy (the same words as
    ``opake train``'s note).

    >>> note = unused_message((), ("m.lora_A.default.weight",))
    >>> note.startswith("1 LoRA A matrices get no gradient on the first step"), "Freeze" in note
    (True, False)
    """
    lora = _expected_lora_a(zero, skipped)
    zero = tuple(name for name in zero if name not in lora)
    parts = []
    if skipped:
        parts.append(f"{', '.join(skipped)} received no gradient entry and will not be updated")
    if zero:
        parts.append(
            f"{', '.join(zero)} received an all-zero gradient from every example of a "
            "batch in which other parameters did not (probably unused by the loss); it "
            "would be updated by noise alone"
        )
    note = lora_a_note(lora)
    if not parts:
        return note if lora else None
    return (
        "trainable parameter(s) without gradient: "
        + "; ".join(parts)
        + ". Freeze them (requires_grad_(False)) and leave them out of the optimizer. "
        "This check looks at the data of the first step(s): it is a diagnostic, not "
        "private." + (f" Also: {note}." if lora else "")
    )
