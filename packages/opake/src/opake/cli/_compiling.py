"""``opake train --compile``: the DP step compiled with ``torch.compile``.

The library compiles (``DPTraining(compile=True)``, see the clipping guide): for one batch
shape, the book-keeping engine's batched forward and backward (a full model), or the vmap
engine's whole clipped-gradient computation (adapters, ``--engine vmap``, dropout); every
physical batch runs as chunks of that many rows, the last one padded with masked rows that add
exactly zero. What is the command's own:

- the refusals, before the plan, of what does not trace into one graph (privacy units,
  activation checkpointing, a kernel backend named with ``--kernels``, DPO's pairs clipped as
  one unit), each saying what to do; ``--kernels auto`` runs the model unpatched (a note says
  so);
- the chunk rows: the microbatch ``--microbatch`` or the memory-aware default chose; when the
  whole Poisson batch runs at once, its largest likely size (one chunk per step, padded); with
  ``--sampler fixed`` and no microbatch, the sampler's ``B_max`` slots;
- the plan's ``compile`` line.

>>> from opake.cli._memory import MicrobatchChoice
>>> compiled_choice(MicrobatchChoice(None, "whole batch at once"), largest=40).microbatch
40
>>> compiled_choice(MicrobatchChoice(8, "--microbatch 8 (given)"), largest=40).microbatch
8
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from opake.cli._memory import MicrobatchChoice

__all__ = ["check_compile", "compile_line", "compiled_choice", "unpatched"]


def check_compile(settings: Any) -> None:
    """Refuse ``--compile`` with what cannot be compiled, saying what to do instead."""
    if not settings.compile:
        return
    why = None
    if settings.privacy_unit is not None:
        why = (
            f"--privacy-unit {settings.privacy_unit}: the plan that keeps each unit's blocks in "
            "one chunk runs on the host and does not trace; train user-level DP without --compile"
        )
    elif settings.checkpointing:
        why = (
            "--checkpointing: torch refuses activation checkpointing inside a compiled "
            "per-example gradient; drop one of them (--compile saves time, --checkpointing "
            "memory)"
        )
    elif settings.kernels not in ("auto", "none"):
        why = (
            f"--kernels {settings.kernels}: Opake's patched model forward does not trace into "
            "one graph yet; use --kernels none (--kernels auto runs the model unpatched when "
            "compiling)"
        )
    elif getattr(settings, "objective", None) == "dpo":
        why = (
            "--objective dpo: a preference record's chosen and rejected rows are clipped "
            "together as one privacy unit, which the compiled step does not support; train DPO "
            "without --compile"
        )
    if why is not None:
        raise ConfigurationError(f"--compile with {why}")


def unpatched(settings: Any, patch: bool, notes: list[str]) -> bool:
    """Whether to apply the model patches: not with ``--compile`` or ``--shard``
    (``--kernels auto`` then runs the model unpatched, and a note says so)."""
    if patch and getattr(settings, "shard", False):
        notes.append(
            "--shard: the model runs unpatched (no loss-only head, no Opake kernels): the "
            "loss-only head holds per-example gradients that per-layer sharded compute cannot "
            "bound"
        )
        return False
    if not (settings.compile and patch):
        return patch
    notes.append(
        "--compile: the model runs unpatched (no loss-only forward, no Opake kernels): the "
        "patched forward does not trace into one graph yet"
    )
    return False


def compiled_choice(choice: MicrobatchChoice, *, largest: int) -> MicrobatchChoice:
    """The compiled chunk for a Poisson run: the chosen microbatch, or, when the whole batch
    runs at once, *largest* rows (the largest likely Poisson batch: one chunk, padded)."""
    from opake.dpsgd.training._compile import compiled_rows

    poisson = (largest, "the largest likely Poisson batch")
    rows, why = compiled_rows(choice.microbatch, fixed_rows=None, poisson=poisson)
    if rows == choice.microbatch:
        return choice
    reason = (
        f"{choice.reason}; --compile: one chunk of {rows} rows per step ({why}), padded and masked"
    )
    return dataclasses.replace(choice, microbatch=rows, reason=reason)


def compile_line(engine: str, rows: int | None, max_batch: int | None) -> str:
    """The plan's ``compile`` line: what is compiled for the run's *engine*, the chunk rows
    (``DPTraining`` falls back to the fixed-shape sampler's *max_batch* slots), and that the
    first steps compile."""
    from opake.dpsgd.training._compile import compiled_rows

    chunk, _ = compiled_rows(rows, fixed_rows=max_batch)
    what = {
        "vmap": "the DP step on the vmap engine",
        "bookkeeping": "the book-keeping engine's batched forward and backward",
        "auto": (
            "the book-keeping engine's batched forward and backward (the whole step on the "
            "vmap engine where few parameters train, e.g. LoRA)"
        ),
    }[engine]
    return (
        f"compile   torch.compile of {what}: chunks of {chunk} rows, the last padded with "
        "masked rows that add exactly zero; the first steps compile (seconds to minutes), the "
        "next ones reuse the graph"
    )
