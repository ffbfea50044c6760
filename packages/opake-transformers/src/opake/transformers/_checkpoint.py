"""The DP state in the Trainer's checkpoints: written beside the weights between two steps
(:func:`save_dp_state`), restored on resume only when it describes the step the checkpoint's
weights were saved at (:func:`load_dp_state`).

A directory whose DP state is behind its weights would resume with an accountant that has not
counted every step the weights were trained with (ε under-reported), so neither half may leave
one: a save in the middle of a logical step (a Ctrl-C between two physical batches, then
``save_model()``) removes the DP state of an earlier save there and warns, and a resume refuses
a DP state whose step count is not the checkpoint's ``global_step`` (``trainer_state.json``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError
from opake.dpsgd.checkpoint import checkpoint_step

if TYPE_CHECKING:
    from opake.dpsgd.training import DPTraining

__all__ = ["DP_STATE_FILE", "load_dp_state", "save_dp_state"]

logger = logging.getLogger("opake.transformers")

#: the DP state (optimizer, noise generator, sampler position, accountant) beside the weights
DP_STATE_FILE = "opake_dp_state.pt"


def save_dp_state(dp: DPTraining, target: Path) -> None:
    """Write ``dp``'s state into ``target``; in the middle of a logical step, remove the DP
    state an earlier save left there (so that the directory cannot be resumed) and warn."""
    path = target / DP_STATE_FILE
    if dp.pending_batches:
        path.unlink(missing_ok=True)
        logger.warning(
            "save_model(%r) in the middle of a logical step (%d physical batch(es) of DP step "
            "%d accumulated, not yet noised): the weights are written but no %s, and this "
            "directory cannot be resumed (its DP state would not match the weights). Save "
            "between two steps — the Trainer's checkpoints (save_strategy) always are — to "
            "resume from it",
            os.fspath(target),
            dp.pending_batches,
            dp.steps + 1,
            DP_STATE_FILE,
        )
        return
    target.mkdir(parents=True, exist_ok=True)
    dp.save(path, rng=False, collective=False)


def load_dp_state(dp: DPTraining, checkpoint: str, global_step: int, owner: str) -> None:
    """Restore ``dp`` from ``checkpoint``; refuse (``ConfigurationError``) a checkpoint without
    a DP state, or whose DP state counts another number of steps than ``global_step`` (the
    step of the checkpoint's ``trainer_state.json``, which the Trainer resumes from)."""
    path = Path(checkpoint) / DP_STATE_FILE
    where = f"resume_from_checkpoint={os.fspath(checkpoint)!r}"
    if not path.is_file():
        raise ConfigurationError(
            f"{where} holds no {DP_STATE_FILE}: without the accountant's history the resumed "
            f"run would forget the privacy already spent; resume from a checkpoint written by "
            f"{owner} between two steps"
        )
    saved = checkpoint_step(path)  # checked before anything is restored into ``dp``
    if saved != global_step:
        raise ConfigurationError(
            f"{where}: its {DP_STATE_FILE} holds {saved} DP steps but its "
            f"trainer_state.json says global_step {global_step}: the DP state was not saved "
            f"with these weights, and resuming would account the wrong number of steps (ε "
            f"wrong for the weights). Resume from a checkpoint-N directory the Trainer wrote, "
            f"or from a directory where {owner}.save_model() and save_state() were called "
            f"together between two steps"
        )
    _check_settings(_settings(dp), _saved_settings(path), where)
    dp.load(path, rng=False, collective=False)
    if dp.steps != saved:  # a file whose components disagree with its own step
        raise ConfigurationError(
            f"{where}: its {DP_STATE_FILE} records step {saved} but restores {dp.steps} DP "
            f"steps: the file was not written by {owner}; resume from a checkpoint it wrote"
        )


def _settings(dp: DPTraining) -> dict[str, float | None]:
    """σ and a fixed clipping norm C (``None`` for an adaptive one, which moves by design)."""
    norm = getattr(dp.clip_state, "clipping_norm", None)
    fixed = type(dp.clip_state).__name__ == "FixedClipping"
    return {
        "noise_multiplier": float(dp.noise_multiplier),
        "per_sample_max_grad_norm": float(norm) if fixed and norm is not None else None,
    }


def _saved_settings(path: Path) -> dict[str, float | None]:
    """:func:`_settings` of the run that wrote ``path`` (read, nothing restored)."""
    from opake.dpsgd.checkpoint._file import _read

    # memory-mapped, as checkpoint_step reads it: the tensors are not read here (dp.load does)
    components = _read(path, "cpu", mmap=True)["components"]
    sigma = components.get("optimizer", {}).get("state", {}).get("noise_multiplier")
    clip = components.get("clip_state", {})
    fixed = isinstance(clip, dict) and clip.get("type") == "FixedClipping"
    norm = clip.get("state", {}).get("clipping_norm") if fixed else None
    return {
        "noise_multiplier": None if sigma is None else float(sigma),
        "per_sample_max_grad_norm": None if norm is None else float(norm),
    }


def _check_settings(
    given: dict[str, float | None], saved: dict[str, float | None], where: str
) -> None:
    """Refuse a resume whose DP arguments differ from the run's: the checkpoint's would be used
    and the ones given silently dropped."""
    changed = [
        f"{name}={given[name]!r} (the run was saved with {saved[name]!r})"
        for name in given
        if given[name] is not None and saved[name] is not None and given[name] != saved[name]
    ]
    if changed:
        raise ConfigurationError(
            f"{where}: {', '.join(changed)}; a resumed run keeps the noise and clipping its "
            "accountant counted. Resume with the run's own arguments, or start a new run "
            "(its ε adds to this one's if both are released)"
        )
