"""What ties a sharded checkpoint together: one ``dp.pt`` on every rank, and its shard files.

Each rank reads the checkpoint directory on its own. Without these checks a rank could load
another run's ``dp.pt`` (a stale copy on one node's disk) or a shard file of another step
dropped into the folder ``dp.pt`` names, and the resumed model would mix two runs or hold an
update the accountant never counted. So:

- every rank hashes its ``dp.pt`` (SHA-256) and the ranks compare the digests before anything
  is restored;
- a save records the SHA-256 of every file of its shard folder in ``dp.pt`` (the ranks hash a
  share each), and a load checks them all (again a share per rank) before the shards are read.

A problem found on one rank is raised on every rank (:func:`agree`), so no rank goes on into
a collective the others left.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from opake.core.errors import OperationError

__all__ = ["agree", "check_files", "file_digest", "same_file_everywhere", "shard_manifest"]

_PIECE = 1 << 22


def file_digest(path: Path) -> str:
    """SHA-256 of the file at ``path`` (hex).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(delete=False) as f:
    ...     _ = f.write(b"abc")
    >>> file_digest(Path(f.name))[:16]
    'ba7816bf8f01cfea'
    """
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(_PIECE):
            digest.update(piece)
    return digest.hexdigest()


def agree(problem: str | None, group: Any, world_size: int) -> None:
    """Raise ``OperationError`` on every rank when any rank has a ``problem`` (one gather)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, problem, group=group)
    found = [(rank, text) for rank, text in enumerate(everyone) if text is not None]
    if found:
        rank, text = found[0]
        raise OperationError(f"load_sharded_checkpoint: rank {rank}: {text}; nothing was restored")


def same_file_everywhere(path: Path, group: Any, world_size: int) -> None:
    """Refuse, on every rank, a ``path`` whose bytes differ between ranks."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, file_digest(path), group=group)
    if len(set(everyone)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, digest in enumerate(everyone):
            groups.setdefault(digest, []).append(rank)
        raise OperationError(
            f"load_sharded_checkpoint: the ranks read different {path.name} files at "
            f"{os.fspath(path)!r} (ranks {sorted(groups.values())} each read another one): a "
            "copy of another run or step on one node's disk? Resume from one directory every "
            "rank reads; nothing was restored"
        )


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def shard_manifest(folder: Path, group: Any, world_size: int, rank: int) -> dict[str, str]:
    """SHA-256 of every file of ``folder`` (each rank hashes a share; one gather)."""
    import torch.distributed as dist

    mine = {
        name: file_digest(folder / name)
        for i, name in enumerate(_files(folder))
        if i % world_size == rank
    }
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    merged: dict[str, str] = {}
    for part in everyone:
        merged.update(part)
    return merged


def check_files(folder: Path, manifest: dict[str, str], world_size: int, rank: int) -> str | None:
    """Why ``folder`` is not the shard folder ``manifest`` describes (``None``: it is); this
    rank hashes its share of the files (with :func:`agree`, every file is checked once)."""
    names = _files(folder)
    if set(names) != set(manifest):
        odd = sorted(set(names) ^ set(manifest))
        return (
            f"the shard folder {os.fspath(folder)!r} holds other files than the save wrote "
            f"({odd[:4]}{' ...' if len(odd) > 4 else ''})"
        )
    for i, name in enumerate(sorted(manifest)):
        if i % world_size == rank and file_digest(folder / name) != manifest[name]:
            return (
                f"{os.fspath(folder / name)!r} is not the file saved with this dp.pt (another "
                "step's or another run's shard?)"
            )
    return None
