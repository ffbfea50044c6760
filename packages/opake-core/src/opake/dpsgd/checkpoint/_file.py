"""The checkpoint file: atomic write, plain-data check, validated read.

File format: one ``torch.save`` archive holding a dict ``{"format": "opake.checkpoint",
"version": 1, "step", "components": {...}, "extra"}``. Only tensors and plain Python values
(dict, list, tuple, str, int, float, bool, None) are written, so loading uses
``torch.load(weights_only=True)`` and never runs code from the file.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from opake.core.errors import InputTypeError, OperationError

FORMAT = "opake.checkpoint"
VERSION = 1
_STATEFUL = ("optimizer", "accountant", "sampler")
_COMPONENTS = ("model", *_STATEFUL, "clip_state", "rng")


class CheckpointError(OperationError):
    """A checkpoint cannot be read, or does not match what it is restored into."""


# -- atomic write ----------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file so that ``path`` holds either its old content or the complete new one.

    ``write`` fills a temporary file in the same directory; it is flushed and ``fsync``-ed, then
    renamed over ``path`` with ``os.replace`` (atomic on POSIX and Windows) and the directory is
    ``fsync``-ed. A crash at any point leaves the old file intact (and possibly a stale
    ``.<name>.*.tmp`` beside it); an exception removes the temporary file. New files are created
    readable by their owner only (``0600``); an existing file's mode is kept.

    Example:
        >>> import pathlib, tempfile
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "data.bin"
        >>> atomic_write(target, lambda f: f.write(b"new")).read_bytes()
        b'new'
    """
    target = Path(path)
    directory = target.parent
    if not directory.is_dir():
        raise CheckpointError(
            f"cannot write {str(target)!r}: directory {str(directory)!r} does not exist; create "
            "it first"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        with suppress(FileNotFoundError):
            os.chmod(tmp_name, target.stat().st_mode & 0o7777)
        os.replace(tmp_name, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(directory)
    return target


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # Windows cannot open a directory; os.replace is durable enough there
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- plain-data checks -----------------------------------------------------------------------


def _check_plain(value: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` could not read back."""
    import torch

    if value is None or isinstance(value, str | bool | int | float | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise InputTypeError(
                    f"{where} has a key {key!r} of type {type(key).__name__}; checkpoint dict keys "
                    "must be str or int"
                )
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise InputTypeError(
        f"{where} is a {type(value).__name__}; a checkpoint holds only tensors and plain values "
        "(dict, list, tuple, str, int, float, bool, None) so that it loads without running code. "
        "Convert it (e.g. numpy arrays to tensors) in the object's state_dict()"
    )


def _read(path: Path, map_location: Any, *, mmap: bool = False) -> dict[str, Any]:
    import pickle
    import zipfile

    import torch

    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (file not found)")
    try:
        with warnings.catch_warnings():
            # a foreign pickle (other protocol) is refused below with a clear error anyway
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as err:  # fmt: skip
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r}: {err}. The file is damaged, truncated, or "
            "not an Opake checkpoint (an interrupted save never replaces the old file: look "
            "for the previous checkpoint)"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not an Opake checkpoint (no '{FORMAT}' marker); write it with "
            "opake.dpsgd.checkpoint.save_checkpoint"
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{str(path)!r} is checkpoint format version {payload.get('version')!r}; this Opake "
            f"reads version {VERSION}"
        )
    step = payload.get("step")
    components = payload.get("components")
    extra = payload.get("extra")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{str(path)!r} has an invalid step {step!r}")
    if not isinstance(components, dict) or not set(components) <= set(_COMPONENTS):
        raise CheckpointError(f"{str(path)!r} has a malformed component table")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{str(path)!r} has a malformed 'extra' entry")
    return payload
