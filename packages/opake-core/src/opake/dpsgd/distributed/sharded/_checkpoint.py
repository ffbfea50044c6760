"""Sharded checkpoints: each rank writes its shards (DCP), rank 0 writes the DP state once.

A checkpoint is a directory:

- ``shards-<step>-<nonce>/`` — ``torch.distributed.checkpoint`` (DCP) of the
  ``fully_shard``-ed module's parameters and the wrapped optimizer's state (Adam's moments):
  every rank writes its own shards, nobody gathers the model; each save writes a folder of its
  own, never over the shards of an earlier save;
- ``dp.pt`` — written last by rank 0 alone, atomically (:func:`~opake.dpsgd.checkpoint.
  save_checkpoint`): the DP state every rank shares — the DP optimizer's step count and noise
  generator, the accountant's history, the clip state, the step — plus each rank's own sampler
  position and RNG states, the name of the shard folder written with it and the SHA-256 of
  each of its files (a load checks them, and that every rank read the same ``dp.pt``, before
  anything is restored: :mod:`._integrity`). It is the commit
  marker: a directory without it is refused on load, and a save that stops before it leaves
  the previous ``dp.pt`` and the shards it names untouched (that earlier checkpoint is what
  loads; the new folder is removed by the next save that commits). Shard folders no ``dp.pt``
  names are removed once a save has committed. (Checkpoints written before this layout kept
  their shards in ``shards/``; they still load.)

Resuming needs the same world size (each rank gets its own sampler and RNG states back; DCP
itself could reshard, the rank-local states cannot). Un-noised pending sums are never saved:
every rank must have stepped (checked on every rank before anything is written).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.distributed._checkpoint import _check_ready, _local_rng, _local_rng_restorer
from opake.dpsgd.distributed._replicas import _gather_rows
from opake.dpsgd.distributed.sharded._integrity import (
    agree,
    check_files,
    same_file_everywhere,
    shard_manifest,
)
from opake.dpsgd.distributed.sharded._plan import mesh_group

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.checkpoint import Checkpoint

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint"]

SHARDS = "shards"
DP_FILE = "dp.pt"
#: key of ``Checkpoint.extra`` holding the per-rank states (removed on load)
RANK_KEY = "opake.sharded"


class _DPState:
    """The DP optimizer's own state without the wrapped optimizer's (sharded, in DCP)."""

    def __init__(self, optimizer: Any) -> None:
        self._opt = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {**self._opt.state_dict(), "optimizer": SHARDS}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        self._opt.check_state_dict({**state, "optimizer": self._opt.optimizer.state_dict()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # the wrapped optimizer was restored from DCP: validate and restore the rest around it
        self._opt.load_state_dict({**state, "optimizer": self._opt.optimizer.state_dict()})


def _sharded_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    inner = getattr(optimizer, "optimizer", None)
    if inner is None or not callable(getattr(optimizer, "load_state_dict", None)):
        raise InputTypeError(
            f"optimizer={type(optimizer).__name__}: expected the ShardedDPOptimizer of the run"
        )
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, inner),
    }


def _rank_states(sampler: Any, rng: bool, group: Any, world_size: int) -> dict[str, Any]:
    """Every rank's sampler state and RNG states (one all-gather)."""
    import torch.distributed as dist

    mine = {
        "sampler": None if sampler is None else sampler.state_dict(),
        "rng": _local_rng() if rng else None,
    }
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return {"world_size": world_size, "ranks": everyone}


def save_sharded_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Path:
    """Save a sharded run: every rank calls it; returns ``directory`` on every rank.

    ``model`` is the ``fully_shard``-ed module, ``optimizer`` its
    :class:`~opake.dpsgd.distributed.ShardedDPOptimizer`, ``sampler`` this rank's sampler; the
    other arguments are :func:`~opake.dpsgd.checkpoint.save_checkpoint`'s. Raises
    :class:`~opake.core.errors.OperationError` on every rank, writing nothing, when a rank
    has accumulated physical batches it did not step.

    >>> import torch
    >>> save_sharded_checkpoint("ckpt", step=1, model=torch.nn.Linear(2, 1), optimizer=None)
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: sharded_clipped_grad: the module has no DTensor ...
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from opake.dpsgd.checkpoint import save_checkpoint

    group = mesh_group(model)
    world_size = dist.get_world_size(group)
    out = Path(directory)
    if RANK_KEY in (extra or {}):
        raise ConfigurationError(f"extra key {RANK_KEY!r} is reserved for Opake")
    _check_ready(None, optimizer, group=group, world_size=world_size, check_sync=False)
    # a fresh folder per save (rank 0's name for all): never the shards an existing dp.pt names
    folder: list[Any] = [f"{SHARDS}-{step}-{secrets.token_hex(4)}"]
    dist.broadcast_object_list(folder, src=dist.get_global_rank(group, 0), group=group)
    dcp_save(_sharded_state(model, optimizer), checkpoint_id=out / folder[0], process_group=group)
    files = shard_manifest(out / folder[0], group, world_size, dist.get_rank(group))
    ranks = {**_rank_states(sampler, rng, group, world_size), "shards": folder[0], "files": files}
    error: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            save_checkpoint(
                out / DP_FILE,
                step=step,
                optimizer=_DPState(optimizer),
                accountant=accountant,
                clip_state=clip_state,
                extra={**(extra or {}), RANK_KEY: ranks},
                rng=False,
            )
        except Exception as exc:  # reported to every rank, then raised on every rank
            error[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(error, src=dist.get_global_rank(group, 0), group=group)
    if error[0] is not None:
        raise OperationError(
            f"save_sharded_checkpoint: rank 0 could not write {os.fspath(out / DP_FILE)!r}: "
            f"{error[0]} (this save did not commit: the directory's earlier checkpoint, if "
            "any, is still the one that loads; a directory without one is refused)"
        )
    if dist.get_rank(group) == 0:
        _remove_other_folders(out, keep=folder[0])
    return out


def _remove_other_folders(out: Path, *, keep: str) -> None:
    """Remove the shard folders of earlier saves (committed or not) once ``keep``'s has
    committed: only ``dp.pt``'s folder is ever read."""
    import shutil

    for path in out.iterdir():
        if path.is_dir() and path.name != keep and _is_shard_folder(path.name):
            shutil.rmtree(path, ignore_errors=True)


def _is_shard_folder(name: str) -> bool:
    """A shard folder's name: ``shards`` (the earlier layout) or ``shards-<step>-<nonce>``."""
    if name == SHARDS:
        return True
    parts = name.split("-")
    return len(parts) == 3 and parts[0] == SHARDS and parts[1].isdigit() and parts[2].isalnum()


def load_sharded_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Any,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    rng: bool = True,
    strict: bool = True,
) -> Checkpoint:
    """Restore :func:`save_sharded_checkpoint`'s directory on every rank (same world size).

    The module and optimizer are built and ``fully_shard``-ed as for the saved run; every
    rank reads its shards, then the DP state (``directory`` visible to every rank). Returns
    the :class:`~opake.dpsgd.checkpoint.Checkpoint` (``step``, ``clip_state``, ``extra``).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from opake.dpsgd.checkpoint._checkpoint import prepare_load

    group = mesh_group(model)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    source = Path(directory)
    found = _flag((source / DP_FILE).is_file())
    rows = _gather_rows(found, group=group, world_size=world_size)
    missing = [r for r in range(world_size) if rows[r, 0] == 0]
    if missing:
        raise OperationError(
            f"load_sharded_checkpoint: {os.fspath(source / DP_FILE)!r} is missing on rank(s) "
            f"{missing}: the checkpoint is incomplete (a save that did not finish) or not on a "
            "filesystem every rank can read"
        )
    same_file_everywhere(source / DP_FILE, group, world_size)
    finish: Callable[[], Checkpoint] | None = None
    restore_rng: Callable[[], None] | None = None
    problem = None
    try:  # everything checked before anything is restored, on every rank
        mine, folder, files = _own_states(source, world_size, rank, sampler, strict)
        if files is not None:
            problem = check_files(source / folder, files, world_size, rank)
        check = getattr(sampler, "check_state_dict", None)
        if callable(check):
            check(mine["sampler"])
        if rng and mine["rng"] is not None:
            restore_rng = _local_rng_restorer(mine["rng"])
        finish = prepare_load(
            source / DP_FILE,
            optimizer=_DPState(optimizer),
            accountant=accountant,
            clip_state=clip_state,
            rng=False,
            strict=strict,
        )
    except Exception as exc:  # raised on every rank below
        problem = f"{type(exc).__name__}: {exc}"
    agree(problem, group, world_size)
    state = _sharded_state(model, optimizer)
    dcp_load(state, checkpoint_id=source / folder, process_group=group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer.optimizer, state["optimizer"])
    assert finish is not None  # agree() raised otherwise
    ckpt = finish()
    extra = dict(ckpt.extra)
    extra.pop(RANK_KEY, None)
    if sampler is not None:
        sampler.load_state_dict(mine["sampler"])
    if restore_rng is not None:
        restore_rng()
    return dataclasses.replace(ckpt, extra=extra)


def _own_states(
    source: Path, world_size: int, rank: int, sampler: Any, strict: bool
) -> tuple[dict[str, Any], str, dict[str, str] | None]:
    """This rank's saved sampler and RNG states, checked before anything is restored, the
    shard folder written with them and its files' digests (``None``: saved before they were
    recorded)."""
    from opake.dpsgd.checkpoint._file import _read

    saved = _read(source / DP_FILE, "cpu")["extra"].get(RANK_KEY)
    got = saved.get("world_size") if isinstance(saved, dict) else None
    if got != world_size:
        raise ConfigurationError(
            f"load_sharded_checkpoint: saved by {got} rank(s), resumed on {world_size}; "
            "resume a sharded checkpoint with the world size that saved it"
        )
    assert isinstance(saved, dict)
    folder = saved.get("shards", SHARDS)  # checkpoints of the earlier layout: shards/
    if not isinstance(folder, str) or not _is_shard_folder(folder):
        raise ConfigurationError(
            f"load_sharded_checkpoint: {os.fspath(source / DP_FILE)!r} names the shard folder "
            f"{folder!r}, which is not one this library writes; the file is damaged or foreign"
        )
    if not (source / folder).is_dir():
        raise OperationError(
            f"load_sharded_checkpoint: the shard folder {os.fspath(source / folder)!r} that "
            f"{DP_FILE} was written with is missing: the checkpoint is incomplete"
        )
    mine: dict[str, Any] = saved["ranks"][rank]
    if sampler is not None and mine["sampler"] is None:
        raise ConfigurationError(
            "load_sharded_checkpoint(sampler=...): the checkpoint holds no sampler state"
        )
    if strict and sampler is None and mine["sampler"] is not None:
        raise ConfigurationError(
            "load_sharded_checkpoint: the checkpoint holds each rank's sampler position; pass "
            "sampler= (a run resumed at another position re-samples its batches), or strict=False"
        )
    files = saved.get("files")
    if files is not None and not (
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise ConfigurationError(
            f"load_sharded_checkpoint: {os.fspath(source / DP_FILE)!r} records its shard files "
            "in a form this library does not write; the file is damaged or foreign"
        )
    return mine, folder, files


def _flag(value: bool) -> torch.Tensor:
    """``value`` as a one-element float64 row (what ``_gather_rows`` gathers)."""
    import torch

    return torch.tensor([1.0 if value else 0.0], dtype=torch.float64)
