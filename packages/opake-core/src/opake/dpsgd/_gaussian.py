"""Gaussian values from the keystream: Box–Muller in fp64, in pieces, on every thread allowed.

Implementation of :meth:`Randomness.normal_pieces <opake.dpsgd.randomness.Randomness>` and
:meth:`~opake.dpsgd.randomness.Randomness.normal_apply` (the conversion is described in
:mod:`opake.dpsgd._randomness`).

**Threads.** The pairs are cut into tasks of :data:`TASK_PAIRS`; :func:`apply` runs them on
``workers`` threads (the calling thread and ``workers - 1`` helpers), each with its own
reused buffers. Every task is a pure function of its pair range, so the values do not depend on
the number of workers or on which thread ran a task. The helpers never enter torch's intra-op
thread pool (two pools on the same cores wait on each other): their torch operations run on
slices of :data:`SLICE` values, below torch's parallel grain (32,768), and the cosine and sine
of a task are computed over a length padded to a multiple of 64, so every value goes through
the same vectorised kernel whatever the slicing (a kernel's scalar remainder loop can round
differently).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["SLICE", "TASK_PAIRS", "Address", "apply", "box_muller", "pieces"]

#: Gaussian pairs per task (512 KiB of fp64 per buffer; 2¹⁵ and 2¹⁷ measured slower on one core)
TASK_PAIRS = 1 << 16
#: values per torch operation on a worker thread: below torch's parallel grain (32,768)
SLICE = 1 << 14
#: the cosine and sine run over a multiple of this many values (whole vector iterations)
_PAD = 64
#: keystream bytes per Gaussian pair: a radius word and an angle word, 64 bits each
PAIR_BYTES = 16
_BLOCK_BYTES = 64
_MASK63 = np.uint64(0x7FFF_FFFF_FFFF_FFFF)


@dataclass(frozen=True, slots=True)
class Address:
    """One keystream: a key, a stream identifier and an index (what a draw reads)."""

    key: bytes
    stream_id: int
    index: int

    def span_into(self, start: int, stop: int, buf: bytearray, at: int) -> memoryview:
        """Keystream bytes ``[start, stop)`` (any byte offsets), written into ``buf`` from
        position ``at`` on (from the block holding ``start``); the returned view is them."""
        from opake.dpsgd._randomness import _fill

        base = start - start % _BLOCK_BYTES
        view = memoryview(buf)[at : at + stop - base]
        _fill(self.key, self.stream_id, self.index, base, view)
        return view[start - base :]

    def pairs_into(
        self,
        pairs: int,
        h0: int,
        h1: int,
        buf: bytearray,
        *,
        k: np.ndarray,
        j: np.ndarray,
    ) -> None:
        """Box–Muller inputs of pairs ``[h0, h1)`` of a draw of ``pairs`` pairs, written as
        fp64 into ``k[:h1-h0]`` (the radius integers, 63 bits) and ``j[:h1-h0]`` (the angle
        integers, signed 64 bits), read through ``buf`` (keystream scratch of at least
        ``16·(h1 - h0) + 128`` bytes: each span may start up to a block early). The radius
        words of all pairs come first, then their angle words."""
        n = h1 - h0
        radius = self.span_into(8 * h0, 8 * h1, buf, 0)
        angle = self.span_into(8 * pairs + 8 * h0, 8 * pairs + 8 * h1, buf, 8 * n + _BLOCK_BYTES)
        bits = np.frombuffer(radius, dtype="<u8")  # little-endian words on every platform
        np.bitwise_and(bits, _MASK63, out=bits)  # the top bit dropped, in the scratch
        np.copyto(k[:n], bits.view("<i8"), casting="unsafe")  # as numpy's astype rounds
        np.copyto(j[:n], np.frombuffer(angle, dtype="<i8"), casting="unsafe")


class _Buffers:
    """One thread's working memory for tasks of up to ``pairs`` pairs (reused task to task)."""

    __slots__ = ("c", "j", "k", "scratch")

    def __init__(self, pairs: int) -> None:
        padded = -(-pairs // _PAD) * _PAD
        self.scratch = bytearray(PAIR_BYTES * pairs + 2 * _BLOCK_BYTES)
        # zeros, so the padding past a short task holds finite values
        self.k = np.zeros(padded, dtype=np.float64)
        self.j = np.zeros(padded, dtype=np.float64)
        self.c = np.zeros(padded, dtype=np.float64)


def _sliced(
    fn: Callable[[torch.Tensor, torch.Tensor], object], x: torch.Tensor, out: torch.Tensor
) -> None:
    for start in range(0, x.numel(), SLICE):
        fn(x[start : start + SLICE], out[start : start + SLICE])


def box_muller(
    k: np.ndarray, j: np.ndarray, c: np.ndarray, n: int, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(r·cos θ, r·sin θ)`` in fp64 from ``k[:n]`` (63-bit integers) and ``j[:n]``
    (signed 64-bit integers), both already converted to fp64, the radius multiplied by
    ``scale``; the results are ``c[:n]`` (cosines) and ``j[:n]`` (sines), ``k`` the radius.
    The three arrays have the same length, a multiple of 64, and ``k``, ``j`` hold finite
    values past ``n``.

    >>> k, j, c = np.zeros(64), np.zeros(64), np.zeros(64)
    >>> cos_part, sin_part = box_muller(k, j, c, 1, 1.0)
    >>> round(float(cos_part[0]) ** 2, 6), float(sin_part[0])
    (88.722839, 0.0)
    """
    import torch

    m = -(-n // _PAD) * _PAD if n else 0
    kk, jj, cc = k[:m], j[:m], c[:m]
    # u = (k + 1/2)·2^-63 with k uniform on [0, 2^63): u ∈ [2^-64, 1] (u = 1 gives radius -0.0)
    np.multiply(kk, 2.0**-63, out=kk)
    np.add(kk, 2.0**-64, out=kk)
    # numpy's fp64 log and sqrt run 2–3× and 1.5× faster than torch's here (same accuracy class)
    np.log(kk, out=kk)
    np.multiply(kk, -2.0, out=kk)
    np.sqrt(kk, out=kk)
    if scale != 1.0:
        np.multiply(kk, scale, out=kk)
    # θ = π·j·2^-63 with j a signed 64-bit integer: θ ∈ [-π, π]
    np.multiply(jj, math.pi * 2.0**-63, out=jj)
    theta, cos_t = torch.from_numpy(jj), torch.from_numpy(cc)
    _sliced(lambda x, out: torch.cos(x, out=out), theta, cos_t)
    _sliced(lambda x, out: torch.sin(x, out=out), theta, theta)
    np.multiply(cc[:n], kk[:n], out=cc[:n])
    np.multiply(jj[:n], kk[:n], out=jj[:n])
    return c[:n], j[:n]


def _task(
    address: Address, span: tuple[int, int, int], scale: float, bufs: _Buffers
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``[p0, p1)`` of a draw of ``pairs`` pairs (``span = (pairs, p0, p1)``)."""
    pairs, p0, p1 = span
    address.pairs_into(pairs, p0, p1, bufs.scratch, k=bufs.k, j=bufs.j)
    return box_muller(bufs.k, bufs.j, bufs.c, p1 - p0, scale)


def pieces(
    address: Address, count: int, scale: float, dtype: torch.dtype
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(position, values)`` pieces of a draw of ``count`` values, each a fresh tensor."""
    import torch

    pairs = (count + 1) // 2
    for p0 in range(0, pairs, TASK_PAIRS):
        p1 = min(pairs, p0 + TASK_PAIRS)
        bufs = _Buffers(p1 - p0)  # fresh: the pieces are handed out
        cos_part, sin_part = _task(address, (pairs, p0, p1), scale, bufs)
        yield p0, torch.from_numpy(cos_part).to(dtype)
        kept = min(p1 - p0, count - pairs - p0)  # an odd count drops the last sine
        if kept > 0:
            yield pairs + p0, torch.from_numpy(sin_part[:kept]).to(dtype)


def apply(
    address: Address,
    count: int,
    scale: float,
    fn: Callable[[int, torch.Tensor], None],
    workers: int,
) -> None:
    """Call ``fn(position, values)`` for every piece of a draw of ``count`` fp64 values, on
    ``workers`` threads at once (``fn`` must be safe to call concurrently on disjoint
    positions; ``values`` is reused after it returns). The first error stops the draw and is
    raised here."""
    import torch

    pairs = (count + 1) // 2
    tasks = iter(range(0, pairs, TASK_PAIRS))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        bufs = _Buffers(min(pairs, TASK_PAIRS))
        while not errors:
            with lock:
                p0 = next(tasks, None)
            if p0 is None:
                return
            try:
                p1 = min(pairs, p0 + TASK_PAIRS)
                cos_part, sin_part = _task(address, (pairs, p0, p1), scale, bufs)
                fn(p0, torch.from_numpy(cos_part))
                kept = min(p1 - p0, count - pairs - p0)
                if kept > 0:
                    fn(pairs + p0, torch.from_numpy(sin_part[:kept]))
            except BaseException as err:  # re-raised on the calling thread
                errors.append(err)
                return

    helpers = [
        threading.Thread(target=work, name=f"opake-noise-{i}", daemon=True)
        for i in range(min(workers, -(-pairs // TASK_PAIRS)) - 1)
    ]
    for thread in helpers:
        thread.start()
    work()
    for thread in helpers:
        thread.join()
    if errors:
        raise errors[0]
