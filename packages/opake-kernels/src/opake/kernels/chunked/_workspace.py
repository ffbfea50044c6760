"""How much scratch memory a chunked kernel may use on a device, and the tiles that fit in it."""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError
from opake.core.plugins import device_type_of
from opake.kernels._args import check_chunk_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "WORKSPACE_CAP",
    "available_memory",
    "resolve_chunking",
    "rows_per_chunk",
    "workspace_budget",
]

_MIB = 1 << 20
#: largest workspace per kernel call, by device type (bytes). Beyond these sizes larger tiles
#: stop paying off (CPU caches; GPU kernels already saturate the device), while memory keeps
#: growing.
WORKSPACE_CAP: dict[str, int] = {
    "cpu": 6 * _MIB,
    "mps": 256 * _MIB,
    "cuda": 1024 * _MIB,
    "xpu": 1024 * _MIB,
}
_FLOOR = 1 * _MIB
_FRACTION = 8  # never take more than 1/8 of the memory currently available
_ASSUMED = 1024 * _MIB  # when a device cannot report its free memory
# fp32 scratch per logits-tile element in the chunked cross-entropy: the tile itself (logits,
# then probabilities, then gradient, in place) and the softcap's tanh; half-precision inputs add
# their own matmul output
_FP32_TEMPS = 2
_MIN_VOCAB_TILE = 128
_MIN_TOKEN_TILE = 16
# a tile spanning the whole vocabulary is preferred once this many token rows fit: the forward
# then computes the gradients in the same pass (no tile is computed twice)
_MIN_FULL_VOCAB_ROWS = 64


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: object) -> int:
    """Bytes currently free for *device*: CUDA/XPU free memory, else host available memory.

    CPU and MPS (unified memory) read the host's available memory through ``psutil`` when it is
    installed, else ``/proc/meminfo`` (a reading is reused for a quarter of a second); when
    nothing can be read, 1 GiB is assumed.

    >>> available_memory("cpu") > 0
    True
    """
    kind = device_type_of(device)
    if kind in ("cuda", "xpu"):
        import torch

        backend = getattr(torch, kind)
        if backend.is_available():
            free, _total = backend.mem_get_info(getattr(device, "device", device))
            return int(free)
        return _ASSUMED
    return _host_available()


#: seconds a reading of the host's available memory is reused: kernels ask once per call
#: (dozens of times per training step), and a fresh reading costs as much as a small kernel
_HOST_TTL_S = 0.25
_clock = time.monotonic
_host_reading: tuple[float, int] | None = None  # (when, bytes) of the last reading


def _host_available() -> int:
    global _host_reading  # one cached reading per process
    now = _clock()
    if _host_reading is not None and now - _host_reading[0] < _HOST_TTL_S:
        return _host_reading[1]
    try:
        import psutil
    except ImportError:
        found = _meminfo_available()
        value = found if found is not None else _ASSUMED
    else:
        value = int(psutil.virtual_memory().available)
    _host_reading = (now, value)
    return value


def workspace_budget(device: object) -> int:
    """The scratch bytes one chunked kernel call may use on *device*.

    ``min(cap for the device type, available memory / 8)``, at least 1 MiB. The caps are in
    :data:`WORKSPACE_CAP`; ``OPAKE_CHUNK_WORKSPACE_MB`` overrides the result.

    >>> workspace_budget("cpu") <= WORKSPACE_CAP["cpu"]
    True
    """
    env = os.environ.get("OPAKE_CHUNK_WORKSPACE_MB", "").strip()
    if env:
        try:
            mb = float(env)
        except ValueError:
            mb = -1.0
        if not mb > 0:
            raise ConfigurationError(
                f"OPAKE_CHUNK_WORKSPACE_MB={env!r}: expected a positive number of MiB."
            )
        return int(mb * _MIB)
    kind = device_type_of(device)
    cap = WORKSPACE_CAP.get(kind, WORKSPACE_CAP["cpu"])
    return max(_FLOOR, min(cap, available_memory(device) // _FRACTION))


def _itemsize(dtype: torch.dtype) -> int:
    return int(getattr(dtype, "itemsize", 4))


def resolve_chunking(
    value: bool | int,
    device: object,
    hidden: int,
    vocab: int,
    dtype: torch.dtype,
    *,
    tokens: int | None = None,
    workspace_bytes: int | None = None,
) -> tuple[int, int] | None:
    """Turn a ``chunked_linear_cross_entropy`` setting into ``(token_tile, vocab_tile)``.

    Args:
        value: ``True`` for automatic tiles; a positive int caps the vocabulary tile width;
            ``False`` or ``0`` disables tiling (returns ``None``: one tile holds every logit).
        device: where the kernel runs (``torch.device``, tensor or ``"cuda:0"``); it sets the
            workspace bound (:func:`workspace_budget`).
        hidden: hidden size ``H``.
        vocab: vocabulary size ``V``.
        dtype: dtype of the hidden states and weight.
        tokens: number of tokens, when known (tiles never exceed it).
        workspace_bytes: explicit workspace bound, overriding the device's.

    One ``token_tile x vocab_tile`` logits tile with its fp32 scratch (plus, for
    half-precision inputs, ``(token_tile + vocab_tile) x H`` gradient products) fits in the
    workspace. A tile spanning the whole vocabulary is chosen when at least 64 token rows (or
    all *tokens*) fit: the forward pass then also computes the gradients, so nothing is
    computed twice. Otherwise the tiles are as square as the bound allows (the backward
    recomputes them, except for the hidden states' gradient alone, which the forward forms
    across tiles); tokens left over when ``tokens`` is small widen the vocabulary tile.

    >>> import torch
    >>> resolve_chunking(False, "cpu", 512, 32000, torch.float32) is None
    True
    >>> resolve_chunking(256, "cpu", 512, 32000, torch.float32, workspace_bytes=64 << 20)[1]
    256
    """
    value = check_chunk_size(value)
    if value is False or value == 0:
        return None
    for name, n in (("hidden", hidden), ("vocab", vocab)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigurationError(f"{name}={n!r}: expected a positive int.")
    budget = workspace_budget(device) if workspace_bytes is None else int(workspace_bytes)
    if budget <= 0:
        raise ConfigurationError(f"workspace_bytes={workspace_bytes!r}: expected a positive int.")
    size = _itemsize(dtype)
    per_elem = 4 * _FP32_TEMPS + (size if size < 4 else 0)
    # half precision: the gradient products come out in the input dtype before being added to
    # the fp32 accumulators (one row per token and per vocabulary entry of the tile)
    row = 0 if size >= 4 else size * hidden
    vocab_cap = vocab if value is True else min(vocab, int(value))
    token_cap = tokens if tokens is not None and tokens > 0 else None

    def token_tile(vt: int) -> int:
        tt = max(_MIN_TOKEN_TILE, (budget - vt * row) // (vt * per_elem + row))
        return tt if token_cap is None else min(tt, token_cap)

    if vocab_cap == vocab:
        full_rows = (budget - vocab * row) // (vocab * per_elem + row)
        wanted = _MIN_FULL_VOCAB_ROWS if token_cap is None else min(token_cap, _MIN_FULL_VOCAB_ROWS)
        if full_rows >= wanted:
            return max(1, token_tile(vocab)), vocab
    side = math.isqrt(max(1, budget // per_elem))
    vt = min(vocab_cap, max(_MIN_VOCAB_TILE, side))
    if vt < vocab_cap and vt > 64:
        vt -= vt % 64
    tt = token_tile(vt)
    if token_cap is not None and tt == token_cap and vt < vocab_cap:
        wider = (budget - tt * row) // (tt * per_elem + row)
        vt = max(vt, min(vocab_cap, wider))
    return max(1, tt), max(1, vt)


def rows_per_chunk(device: object, row_bytes: int) -> int:
    """Rows of *row_bytes* scratch each that fit one chunk of the device's workspace (>= 1)."""
    return max(1, workspace_budget(device) // max(1, row_bytes))
