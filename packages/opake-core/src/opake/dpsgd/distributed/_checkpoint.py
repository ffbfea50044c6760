"""Checkpoints in data-parallel runs: rank 0 writes, atomically, after every rank agreed.

Implementation of :func:`opake.dpsgd.distributed.save_checkpoint_distributed` and
:func:`~opake.dpsgd.distributed.load_checkpoint_distributed`, on top of
:mod:`opake.dpsgd.checkpoint` (whose :func:`~opake.dpsgd.checkpoint.atomic_write` guarantees
that a crash while writing leaves the previous file intact).
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.distributed._comm import fingerprint
from opake.dpsgd.distributed._env import _world
from opake.dpsgd.distributed._replicas import _gather_rows, _replica_tensors, unwrap_ddp

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from opake.dpsgd.checkpoint import Checkpoint

__all__ = ["load_checkpoint_distributed", "save_checkpoint_distributed"]

#: Key of ``Checkpoint.extra`` holding every rank's RNG states (removed on load).
RANK_STATE_KEY = "opake.distributed"


def _local_rng() -> dict[str, Any]:
    import numpy as np
    import torch

    from opake.dpsgd.checkpoint._components import cuda_rng_states, numpy_legacy_state

    name, keys, pos, has_gauss, cached = numpy_legacy_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "cuda": cuda_rng_states(),
    }


def _nothing() -> None:
    """No RNG states of this rank to restore."""


def _local_rng_restorer(state: Any) -> Callable[[], None]:
    """What restores one rank's RNG states ``state`` (of :func:`_local_rng`), each validated
    on a throwaway generator first: a damaged entry is refused before anything is restored."""
    from opake.dpsgd.checkpoint import CheckpointError
    from opake.dpsgd.checkpoint._components import _restore_rng

    try:
        version, internal, gauss = state["python"]
        name, keys, pos, has_gauss, cached = state["numpy"]
        plain = {
            "torch": state["torch"],
            "python": (version, tuple(internal), gauss),
            "numpy": {
                "name": name,
                "keys": keys,
                "pos": pos,
                "has_gauss": has_gauss,
                "cached_gaussian": cached,
            },
            "cuda": state["cuda"],
        }
    except (LookupError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint's per-rank RNG states are malformed: {err}") from err
    return _restore_rng(plain)


def _rank_rng(path: str | os.PathLike[str], rank: int, world_size: int) -> Callable[[], None]:
    """The restore of this rank's own RNG states saved in the file at ``path`` (validated
    now), or nothing when they were saved under another world size (rank 0's stand)."""
    from opake.dpsgd.checkpoint import CheckpointError
    from opake.dpsgd.checkpoint._file import _read

    saved = _read(Path(path), "cpu", mmap=True)["extra"].get(RANK_STATE_KEY)
    if not isinstance(saved, dict) or saved.get("world_size") != world_size:
        return _nothing
    states = saved.get("rng")
    if not isinstance(states, list | tuple) or len(states) != world_size:
        raise CheckpointError("checkpoint's per-rank RNG states are malformed")
    return _local_rng_restorer(states[rank])


def save_checkpoint_distributed(
    path: str | os.PathLike[str],
    *,
    step: int,
    model: Any = None,
    optimizer: Any = None,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
    group: Any = None,
    check_sync: bool = True,
) -> Path:
    """Save the training state of a data-parallel run: every rank calls it, rank 0 writes.

    1. Every rank reports (one small all-gather, which is also the barrier) whether it is
       ready — no un-stepped accumulation in ``optimizer`` — and, with ``check_sync``, a
       fingerprint of its ``model``; if any rank is not ready or the replicas differ, every
       rank raises :class:`~opake.core.errors.OperationError` and nothing is written. A rank
       that failed before reaching this point makes the collective fail: nothing is written.
    2. With ``rng``, every rank's RNG states are gathered so each rank can restore its own.
    3. Rank 0 writes with :func:`opake.dpsgd.checkpoint.save_checkpoint` (temporary file,
       ``fsync``, atomic rename: the previous checkpoint stays intact until the new one is
       complete); the others wait for its result and raise if the write failed.

    Arguments are those of :func:`~opake.dpsgd.checkpoint.save_checkpoint` (``model`` may be
    the DDP wrapper: its inner module is saved), plus ``group`` (default: the default process
    group) and ``check_sync``. Returns the path on every rank. In a single process this is
    ``save_checkpoint``.

    Example:
        >>> import pathlib, tempfile, torch
        >>> from opake.dpsgd.distributed import save_checkpoint_distributed
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt.pt"
        >>> save_checkpoint_distributed(path, step=3, model=torch.nn.Linear(2, 1)).name
        'ckpt.pt'
    """
    import torch.distributed as dist

    from opake.dpsgd.checkpoint import save_checkpoint

    model = unwrap_ddp(model)
    _refuse_sharded(model)
    rank, world_size = _world(group)
    extra_out: dict[str, Any] = dict(extra or {})
    if RANK_STATE_KEY in extra_out:
        raise ConfigurationError(f"extra key {RANK_STATE_KEY!r} is reserved for Opake")
    state: dict[str, Any] = {
        "step": step,
        "model": model,
        "optimizer": optimizer,
        "accountant": accountant,
        "sampler": sampler,
        "clip_state": clip_state,
        "rng": rng,
    }
    if world_size == 1:
        return save_checkpoint(path, **state, extra=extra or None)
    _check_ready(model, optimizer, group=group, world_size=world_size, check_sync=check_sync)
    if rng:
        states: list[Any] = [None] * world_size
        dist.all_gather_object(states, _local_rng(), group=group)
        extra_out[RANK_STATE_KEY] = {"world_size": world_size, "rng": states}
    error: str | None = None
    written: Path | None = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            written = save_checkpoint(path, **state, extra=extra_out or None)
        except Exception as exc:  # reported to every rank below, then re-raised here
            failure = exc
            error = f"{type(exc).__name__}: {exc}"
    outcome: list[Any] = [error]
    dist.broadcast_object_list(outcome, src=_src(group), group=group)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise OperationError(
            f"save_checkpoint_distributed: rank 0 could not write {os.fspath(path)!r}: "
            f"{outcome[0]} (the previous checkpoint, if any, is intact)"
        )
    return written if written is not None else Path(path)


def _check_ready(
    model: Any, optimizer: Any, *, group: Any, world_size: int, check_sync: bool
) -> None:
    """One all-gather (also the barrier): refuse unless every rank stepped and, with
    ``check_sync``, every rank's model equals rank 0's."""
    import torch

    pending = int(getattr(optimizer, "pending_batches", 0) or 0)
    local_fp = (
        fingerprint([t for _, t in _replica_tensors(model)])
        if check_sync and model is not None
        else (0.0, 0.0)
    )
    rows = _gather_rows(
        torch.tensor([float(pending), *local_fp], dtype=torch.float64),
        group=group,
        world_size=world_size,
    )
    busy = [r for r in range(world_size) if rows[r, 0] > 0]
    if busy:
        raise OperationError(
            f"save_checkpoint_distributed: rank(s) {busy} have accumulated physical batches "
            "that were not stepped; call step() on every rank before checkpointing (nothing "
            "was written)"
        )
    if check_sync and model is not None:
        differing = [r for r in range(world_size) if not torch.equal(rows[r, 1:], rows[0, 1:])]
        if differing:
            raise OperationError(
                f"save_checkpoint_distributed: the model on rank(s) {differing} differs from "
                "rank 0's; rank 0 would save a state the other ranks do not share (nothing was "
                "written). Check that every rank uses DistributedDPOptimizer with the same seeds"
            )


def _refuse_sharded(model: Any) -> None:
    from opake.dpsgd.distributed._rows import _is_sharded

    tensors = _replica_tensors(model) if model is not None else []
    if any(_is_sharded(t) for _, t in tensors):
        raise ConfigurationError(
            "save_checkpoint_distributed: the model has sharded (FSDP2 DTensor) parameters; "
            "rank 0 alone cannot write them. Use torch.distributed.checkpoint (DCP) for "
            "sharded states, or gather_full_params(model) and save the full tensors"
        )


def _src(group: Any) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_global_rank(group, 0))


def load_checkpoint_distributed(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: Any = None,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    rng: bool = True,
    strict: bool = True,
    map_location: Any = "cpu",
    group: Any = None,
) -> Checkpoint:
    """Every rank restores the checkpoint rank 0 wrote (``path`` must be visible to all ranks).

    Arguments are those of :func:`opake.dpsgd.checkpoint.load_checkpoint`. Every rank first
    checks that the file exists (one all-gather: a path missing on some rank — no shared
    filesystem — raises on every rank before anything is restored). Every rank then reads and
    validates the file against its own objects without modifying them, and the ranks agree
    (a second all-gather) before any of them restores: if the file is refused on some ranks
    only (another copy of the file, an accountant or sampler of another kind or
    configuration), each refusing rank raises its own error and every other rank raises
    :class:`~opake.core.errors.ConfigurationError` naming the refusing ranks — nothing is
    restored on any rank, so no rank trains on alone. With ``rng``, each rank gets back its
    *own* RNG states when the world size is unchanged (rank 0's otherwise, as
    ``load_checkpoint`` restores them). The replicas are then verified to be identical.
    Returns the :class:`~opake.dpsgd.checkpoint.Checkpoint` (without Opake's per-rank entry
    in ``extra``).

    Example:
        >>> import pathlib, tempfile, torch
        >>> from opake.dpsgd.distributed import (load_checkpoint_distributed,
        ...                                      save_checkpoint_distributed)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt.pt"
        >>> _ = save_checkpoint_distributed(path, step=5, model=torch.nn.Linear(2, 1))
        >>> load_checkpoint_distributed(path, model=torch.nn.Linear(2, 1)).step
        5
    """
    import torch

    from opake.dpsgd.distributed._replicas import check_replicas_in_sync

    model = unwrap_ddp(model)
    rank, world_size = _world(group)
    if world_size > 1:
        exists = _gather_rows(
            torch.tensor([1.0 if Path(path).is_file() else 0.0], dtype=torch.float64),
            group=group,
            world_size=world_size,
        )
        missing = [r for r in range(world_size) if exists[r, 0] == 0]
        if missing:
            raise OperationError(
                f"load_checkpoint_distributed: {os.fspath(path)!r} does not exist on rank(s) "
                f"{missing}; put checkpoints on a filesystem every rank can read"
            )
    ckpt, rank_rng = _prepare_together(
        path,
        {
            "model": model,
            "optimizer": optimizer,
            "accountant": accountant,
            "sampler": sampler,
            "clip_state": clip_state,
            "rng": rng,
            "strict": strict,
            "map_location": map_location,
        },
        group=group,
        rank=rank,
        world_size=world_size,
    )
    extra = dict(ckpt.extra)
    extra.pop(RANK_STATE_KEY, None)
    rank_rng()
    if world_size > 1 and model is not None:
        check_replicas_in_sync(model, group=group, what="parameters after loading")
    return dataclasses.replace(ckpt, extra=extra)


def _prepare_together(
    path: str | os.PathLike[str],
    options: dict[str, Any],
    *,
    group: Any,
    rank: int,
    world_size: int,
) -> tuple[Checkpoint, Callable[[], None]]:
    """``prepare_load`` on every rank (and, with ``rng``, this rank's own saved RNG states
    validated), then one all-gather of the verdicts: a rank that refused the file raises its
    own error, every other rank a :class:`~opake.core.errors.ConfigurationError` naming the
    refusing ranks, before any rank has restored anything. Once every rank accepted, restores
    the file and returns its checkpoint with the restore of this rank's RNG states."""
    from opake.dpsgd.checkpoint._checkpoint import prepare_load
    from opake.dpsgd.distributed._agree import raise_together

    finish: Callable[[], Checkpoint] | None = None
    rank_rng: Callable[[], None] = _nothing
    problem: Exception | None = None
    try:  # read and validate everything; nothing is restored yet
        finish = prepare_load(path, **options)
        if options["rng"]:
            rank_rng = _rank_rng(path, rank, world_size)
    except Exception as exc:  # every rank hears of it below, then it is re-raised here
        problem = exc
    raise_together(
        problem,
        group=group,
        world_size=world_size,
        what=f"load_checkpoint_distributed: {os.fspath(path)!r}",
    )
    assert finish is not None
    return finish(), rank_rng
