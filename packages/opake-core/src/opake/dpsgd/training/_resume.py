"""What a resumed :class:`~opake.dpsgd.training.DPTraining` checks before anything is restored.

A saved state is compared with the training it is loaded into (the settings that decide the
accounting, σ, the clipping) and with itself (the steps its optimizer took, the steps its
accountant recorded, the count-noise index of adaptive clipping): a refusal comes before any
component changes, and — under a process group — on every rank together.

A checkpoint is not authenticated: these checks catch a damaged file, a file of another run
and a state that does not fit, not a forgery (a file edited consistently can claim any history;
keep checkpoints where only the run's owner can write — they are created owner-only).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from opake.dpsgd.clipping import ClipState
    from opake.dpsgd.training._persist import Parts

#: the key of a checkpoint's ``extra`` holding DPTraining's settings
CONFIG_KEY = "opake.training"


def check_config(mine: Mapping[str, Any], saved: Any) -> None:
    """The settings that decide the accounting (N, q, δ, target ε, secure) must match."""
    if not isinstance(saved, Mapping):
        raise ConfigurationError("the saved training state has no configuration")
    diffs = [
        f"{key} {saved.get(key)!r} (saved) vs {value!r} (now)"
        for key, value in mine.items()
        if key != "world_size" and saved.get(key) != value
    ]
    if diffs:
        raise ConfigurationError(
            "the saved training state was made with other settings: "
            + "; ".join(diffs)
            + "; resume with the saved settings (they decide the privacy accounting)"
        )


def _check_clip(mine: ClipState, saved: ClipState) -> None:
    """A resumed training clips as it was built to: the saved clipping method with the same
    settings (all but the values that change from step to step, ``ClipState.evolving``: an
    adaptive C) — the loaded state would otherwise replace the new ones unnoticed."""
    if type(saved) is not type(mine):
        raise ConfigurationError(
            f"the saved training state clips with {type(saved).__name__}, this training with "
            f"{type(mine).__name__}; resume with the saved clipping method"
        )
    evolving = type(mine).evolving
    settings = [{k: v for k, v in s.to_dict().items() if k not in evolving} for s in (saved, mine)]
    if settings[0] != settings[1]:
        raise ConfigurationError(
            f"the saved training state clips with {saved!r}, this training with {mine!r}; "
            "resume with the saved clipping settings, or start a new training to clip "
            "otherwise"
        )


def _check_optimizer(parts: Parts, saved: Mapping[str, Any]) -> None:
    """A resumed training noises and divides as it was built to: the DP optimizer's saved σ
    and divisor would otherwise replace the training's unnoticed (ε stays right — the
    accountant records the σ used — but the setting given is ignored). The σ its noise
    source holds must equal its own: ``DPOptimizer.check_state_dict`` refuses it otherwise."""
    sigma = saved.get("noise_multiplier")
    if sigma is not None and sigma != parts.noise_multiplier:
        raise ConfigurationError(
            f"the saved training state noises with noise_multiplier={sigma!r}, this training "
            f"with {parts.noise_multiplier!r}; resume with noise_multiplier={sigma!r} (or the "
            "target_epsilon and steps that calibrated it), or start a new training to noise "
            "otherwise"
        )
    divisor = saved.get("expected_batch_size")
    mine = getattr(parts.optimizer, "expected_batch_size", None)
    if divisor is not None and mine is not None and divisor != mine:
        raise ConfigurationError(
            f"the saved training state divides the noisy sum by expected_batch_size="
            f"{divisor!r}, this training by {mine!r}; resume with the saved dataset size and "
            "sampling rate"
        )


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else None


def _check_counts(
    parts: Parts, steps: Any, accountant: Any, clip: ClipState | None, header: int | None
) -> None:
    """The saved state agrees with itself: the file's step is its optimizer's, its accountant
    recorded at least those steps at this training's rate (a shared accountant may hold more),
    adaptive clipping's count noise accounted at every one, and a secure count-noise index is
    not one this training's key has already released (the clip's step may trail the
    optimizer's: a step whose update raised was noised and accounted, its clip not moved)."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        return  # the optimizer's own check refuses it
    damaged = "; the file is damaged or was not written by DPTraining.save()"
    if header is not None and header != steps:
        raise ConfigurationError(
            f"the saved state records step {header} but {steps} DP steps{damaged}"
        )
    phases = _phases(parts, accountant)
    count_sigma = getattr(clip, "count_noise_multiplier", None)
    rate = parts.config["sample_rate"]
    if phases is not None:
        # this training's steps: at its rate q (fixed for its life), with its count noise; a
        # shared accountant may hold more steps of other runs
        mine = sum(
            p.num_steps
            for p in phases
            if p.sample_rate == rate and p.count_noise_multiplier == count_sigma
        )
        if mine < steps:
            raise ConfigurationError(
                f"the saved accountant records {mine} steps at this training's sampling rate "
                f"{rate!r} (and count noise σ_b={count_sigma!r}) but the optimizer took "
                f"{steps}: ε would be under-reported{damaged}"
            )
    if count_sigma is None or getattr(clip, "seed", None) is not None:
        return
    index = int(getattr(clip, "step", 0))
    source = getattr(getattr(parts.optimizer, "noise", None), "randomness", None)
    free = source.next_free("count") if source is not None else 0
    if index < free:
        raise ConfigurationError(
            f"the saved adaptive clipping is at step {index}, but this training's key has "
            f"already given the count noise of steps 0..{free - 1}: the next count noise "
            "would repeat one already released; load the state into a new training (it draws "
            f"a fresh secure key){damaged}"
        )


def _phases(parts: Parts, accountant: Any) -> list[Any] | None:
    """The saved accountant's history, or ``None`` when it does not fit (its loader says why)."""
    check = getattr(parts.accountant, "check_state_dict", None)
    if accountant is None or not callable(check):
        return None
    try:
        return list(check(accountant))
    except (ConfigurationError, KeyError, TypeError, ValueError):
        return None


def check_state(
    parts: Parts,
    *,
    optimizer: Any,
    accountant: Any,
    clip: ClipState | None,
    header: int | None = None,
) -> None:
    """Every check of a saved state (its DP optimizer's and accountant's state dicts, its clip
    state, a file's step ``header``) against ``parts``, the training it is loaded into."""
    if clip is not None:
        _check_clip(parts.clip_state, clip)
    if isinstance(optimizer, Mapping):
        _check_optimizer(parts, optimizer)
        _check_counts(parts, optimizer.get("steps"), accountant, clip, header)


def check_file(parts: Parts, path: Path) -> None:
    """The checks of :func:`check_state` on the file at ``path`` (a sharded training's DP state
    file in that directory), before any loader restores anything: a refusal after the restore
    would leave the accountant, sampler and noise counter wound back. A file this rank cannot
    see is left to the loader, which reports it on every rank together."""
    from opake.dpsgd.checkpoint._components import _decode_value, _self_describing
    from opake.dpsgd.checkpoint._file import _read

    if parts.sharded is not None:
        from opake.dpsgd.distributed.sharded._checkpoint import DP_FILE

        path = path / DP_FILE
    if not path.is_file():
        return
    payload = _read(path, "cpu", mmap=True)  # the header; the tensors stay on disk
    config = payload["extra"].get(CONFIG_KEY)
    if config is not None:
        check_config(parts.config, config)
    # else: a checkpoint of the same components written without DPTraining: σ and the counts
    # are compared below, the sampler's N and q and the noise's secure-or-seeded mode by their
    # loaders, and a file without an accountant is refused; δ and a target ε only decide what
    # is reported (ε of the whole restored history), so nothing spent is forgotten
    components = payload["components"]
    saved = components.get("clip_state")
    if saved is not None and not _self_describing(saved):
        raise ConfigurationError(
            "the saved training state's clipping is not an Opake clip state (a damaged or "
            "foreign file); resume from a file DPTraining.save() wrote"
        )
    clip = None if saved is None else cast("ClipState", _decode_value(parts.clip_state, saved))
    check_state(
        parts,
        optimizer=_get(components.get("optimizer"), "state"),
        accountant=_get(components.get("accountant"), "state"),
        clip=clip,
        header=payload["step"] if config is not None else None,
    )


def check_file_together(parts: Parts, path: Path, *, collective: bool) -> None:
    """:func:`check_file` on every rank at once: under a process group one all-gather shares
    each rank's verdict, so a refusal on some ranks only (a file only they can see, a rank
    built with other settings) raises on every rank before anything is restored — no rank goes
    on into the loader's collectives to wait for one that has left."""
    from opake.dpsgd.distributed._agree import raise_together

    problem: Exception | None = None
    try:
        check_file(parts, path)
    except Exception as err:  # any failure: the other ranks must hear of it
        problem = err
    world_size = parts.config["world_size"] if collective else 1
    raise_together(
        problem, group=parts.group, world_size=world_size, what="the saved training state"
    )
