"""Cryptographically secure, counter-based randomness for noise and sampling.

Implementation of :mod:`opake.dpsgd.randomness`.

Every draw is a pure function of ``(key, stream, index)``: the ChaCha20 keystream (RFC 8439,
through the ``cryptography`` package, i.e. OpenSSL) under a 256-bit key, with the 96-bit nonce
``stream (4 bytes) ‖ index (8 bytes)`` and the block counter starting at 0. The key is either
drawn from the operating system (``secrets.token_bytes(32)``: secure, never stored) or derived
from an integer seed with SHA-256 (reproducible, **not private**: whoever knows the seed
replays every draw). Nothing else is kept, so a seeded source resumes exactly from a counter.

Conversions (all in fixed little-endian layouts, identical on every platform):

* Gaussian: Box–Muller on pairs, computed in fp64 whatever the output dtype. The radius
  ``sqrt(-2 ln u)`` takes ``u = (k + ½)·2⁻⁶³`` from a 63-bit integer ``k`` (so ``u ∈ [2⁻⁶⁴, 1]``
  and the tail reaches ≈ 9.42σ), the angle ``π·j·2⁻⁶³`` from a signed 64-bit integer ``j``
  (resolution π·2⁻⁵³ after the conversion to fp64); 16 keystream bytes per pair. An fp32
  result is the fp64 value rounded once. On the CPU, in pieces of 2¹⁷ pairs through one
  reused keystream buffer (a fresh buffer per piece, and larger pieces, measured slower).
  Why fp64 and 64 angle bits: ``docs/guide/privacy-noise.md``.
* Bernoulli(p): a 64-bit integer below ``⌊p·2⁶⁴⌋`` (probability within 2⁻⁶⁴ of p).
* Uniform subsets and permutations: sort by 64-bit random keys (ties broken by position).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import torch
    from cryptography.hazmat.primitives.ciphers import CipherContext

__all__ = ["STREAMS", "Randomness", "check_seed"]

#: stream identifiers (the first 4 nonce bytes): one per use, so one key never repeats a stream
STREAMS = {
    "noise": 0x4E6F6973,
    "poisson": 0x506F6973,
    "truncate": 0x5472756E,
    "shuffle": 0x53687566,
    "cap": 0x43617073,
    "count": 0x436F756E,
}
_SEED_LABEL = b"opake.randomness.seeded.v1:"
_FINGERPRINT_LABEL = b"opake.randomness.fingerprint.v1:"
_KEY_BYTES = 32
_MASK63 = np.uint64(0x7FFF_FFFF_FFFF_FFFF)


#: 64-bit words drawn per piece by :meth:`Randomness.bernoulli` (16 MiB of keystream)
_CHUNK_WORDS = 1 << 21
#: Gaussian pairs per piece of :meth:`Randomness.normal_pieces` (2 MiB of keystream: 2¹⁶ and
#: 2¹⁸ measured 5–10 % slower on a 2-core CPU, 2²¹ twice as slow)
_CHUNK_PAIRS = 1 << 17
#: keystream bytes per Gaussian pair: a radius word and an angle word, 64 bits each
_PAIR_BYTES = 16
_BLOCK_BYTES = 64
#: the plaintext the keystream is read through (ChaCha20 of zeros), shared and never written:
#: a fresh zero buffer per draw cost more than the cipher (each of its pages faulted in)
_ZEROS = memoryview(bytes(1 << 20))


def _cipher(key: bytes, stream: int, index: int, block: int = 0) -> CipherContext:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    # cryptography's 16-byte ChaCha20 "nonce" is the 32-bit block counter, then the 96-bit nonce
    if not 0 <= block < 2**32:
        raise ConfigurationError("a draw of more than 256 GiB of keystream per step")
    nonce = block.to_bytes(4, "little") + stream.to_bytes(4, "little") + index.to_bytes(8, "little")
    return Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()


class Randomness:
    """A keyed ChaCha20 random source: secure (an OS key) or seeded (a key derived from a seed).

    Build it with :meth:`secure` (the default everywhere in Opake) or :meth:`seeded` (explicit,
    reproducible, not private). Every draw is addressed by a *stream* (what it is for:
    ``"noise"``, ``"poisson"``, ...) and an *index* (the step): the same source, stream and
    index always give the same values, and different ones are independent.

    The key of a secure source never leaves the object except through :meth:`export_key`
    (for sharing it between the ranks of one run); :meth:`state_dict`-style persistence stores
    only the seed of a seeded source.

    Example:
        >>> a = Randomness.seeded(7)
        >>> b = Randomness.seeded(7)
        >>> bool((a.uint64("noise", 0, 4) == b.uint64("noise", 0, 4)).all())
        True
        >>> a.is_secure, Randomness.secure().is_secure
        (False, True)
    """

    __slots__ = ("_key", "_reserved", "_secure", "_seed")

    def __init__(self, *, key: bytes, secure: bool, seed: int | None = None) -> None:
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise InputTypeError(f"key: expected {_KEY_BYTES} bytes")
        self._key = key
        self._secure = secure
        self._seed = seed
        self._reserved: dict[str, int] = {}  # stream -> next index a use-once draw may take

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def secure(cls) -> Randomness:
        """A fresh 256-bit key from the operating system's CSPRNG (``secrets``)."""
        return cls(key=secrets.token_bytes(_KEY_BYTES), secure=True)

    @classmethod
    def seeded(cls, seed: int) -> Randomness:
        """A key derived from ``seed`` (SHA-256): reproducible, and **not private**."""
        seed = check_seed(seed)
        key = hashlib.sha256(_SEED_LABEL + str(seed).encode("ascii")).digest()
        return cls(key=key, secure=False, seed=seed)

    @classmethod
    def from_key(cls, key: bytes) -> Randomness:
        """A secure source with a key exported by another one (:meth:`export_key`): how the
        ranks of one run share the key drawn on rank 0."""
        if not isinstance(key, bytes | bytearray) or len(key) != _KEY_BYTES:
            raise InputTypeError(f"key: expected {_KEY_BYTES} bytes from Randomness.export_key()")
        return cls(key=bytes(key), secure=True)

    # -- properties ------------------------------------------------------------------------

    @property
    def is_secure(self) -> bool:
        """Whether the key came from the operating system (nothing stored can replay it)."""
        return self._secure

    @property
    def seed(self) -> int | None:
        """The seed of a seeded source; ``None`` when secure."""
        return self._seed

    @property
    def mode(self) -> str:
        """``"secure"`` or ``"seeded (not private)"`` (what run reports print)."""
        return "secure" if self._secure else "seeded (not private)"

    @property
    def fingerprint(self) -> str:
        """16 hex digits of a one-way hash of the key: compare sources without revealing it."""
        return hashlib.sha256(_FINGERPRINT_LABEL + self._key).hexdigest()[:16]

    def export_key(self) -> bytes:
        """The raw key, to share with the other ranks of the same run (never store it)."""
        return self._key

    def __repr__(self) -> str:
        if self._secure:
            return f"Randomness(secure, fingerprint={self.fingerprint})"
        return f"Randomness(seeded, seed={self._seed})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Randomness):
            return NotImplemented
        return self._key == other._key and self._secure == other._secure

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __copy__(self) -> Randomness:
        # a secure source is never duplicated: a copy would reserve its draws apart from the
        # original's and give released noise again (copy.deepcopy of an optimizer shares it)
        return self if self._secure else Randomness(key=self._key, secure=False, seed=self._seed)

    def __deepcopy__(self, memo: dict[int, object]) -> Randomness:
        return self.__copy__()

    # -- use-once draws --------------------------------------------------------------------

    def reserve(self, stream: str, index: int) -> None:
        """Take draw ``index`` of ``stream`` for one use (the noise of one step): a secure
        source refuses an index below the next free one, since every consumer of one key reads
        the same values — a second noise generator on this source, or one loaded with an
        earlier state, would release noise already released (two outputs then cancel it).
        A seeded source (reproducible, not private) replays by design and reserves nothing."""
        stream_id, index = _stream_id(stream), _index(index)
        free = self.next_free(stream)
        if self._secure and index < free:
            raise OperationError(
                f"{self!r} already gave draws 0..{free - 1} of stream {stream!r} (id "
                f"{stream_id:#x}); index {index} would repeat values already released. Give "
                "each noise generator a key of its own: leave randomness= out (each optimizer or "
                "DPTraining then draws a fresh secure key), or pass a new Randomness.secure() — "
                "also when loading a saved state into a new object"
            )
        if self._secure:
            self._reserved[stream] = index + 1

    def next_free(self, stream: str) -> int:
        """The lowest index of ``stream`` :meth:`reserve` still accepts (0 when seeded)."""
        return self._reserved.get(stream, 0)

    # -- raw draws -------------------------------------------------------------------------

    def keystream(self, stream: str, index: int, nbytes: int, *, offset: int = 0) -> bytearray:
        """``nbytes`` keystream bytes of ``(stream, index)``, from byte ``offset`` (a multiple of
        64) on."""
        stream_id = _stream_id(stream)
        index = _index(index)
        if offset % _BLOCK_BYTES:
            raise ConfigurationError(f"offset={offset}: expected a multiple of {_BLOCK_BYTES}")
        out = bytearray(nbytes)
        _fill(self._key, stream_id, index, offset, memoryview(out))
        return out

    def uint64(self, stream: str, index: int, count: int, *, offset: int = 0) -> np.ndarray:
        """``count`` independent uniform 64-bit integers (``numpy.uint64``), words ``offset``
        (a multiple of 8) onwards of the stream."""
        raw = self.keystream(stream, index, 8 * count, offset=8 * offset)
        return np.frombuffer(raw, dtype="<u8").astype(np.uint64, copy=False)

    # -- distributions ---------------------------------------------------------------------

    def normal(
        self,
        stream: str,
        index: int,
        count: int,
        *,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """``count`` normal values of standard deviation ``scale`` (CPU tensor, fp32 by default,
        or fp64; computed in fp64 either way, an fp32 result rounded once)."""
        import torch

        out = torch.empty(count, dtype=_normal_dtype(dtype))
        for start, values in self.normal_pieces(stream, index, count, dtype=dtype, scale=scale):
            out[start : start + values.numel()] = values
        return out

    def normal_pieces(
        self,
        stream: str,
        index: int,
        count: int,
        *,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The values of :meth:`normal` as ``(position, values)`` pieces, in bounded memory.

        Pair ``i`` of the Box–Muller transform gives position ``i`` (its cosine) and position
        ``pairs + i`` (its sine); each piece is a run of consecutive positions, and together
        the pieces cover ``range(count)`` once, with exactly the values :meth:`normal` returns.
        No piece holds more than 2¹⁷ values, so drawing the noise of a large model never holds
        its whole keystream at once. ``scale`` multiplies the radius (one rounding) before the
        cosine and sine do. The pieces are fresh tensors, the caller's to modify.

        Example:
            >>> import torch
            >>> source = Randomness.seeded(0)
            >>> pieces = list(source.normal_pieces("noise", 0, 5, dtype=torch.float64))
            >>> [(start, values.numel()) for start, values in pieces]
            [(0, 3), (3, 2)]
        """
        dtype = _normal_dtype(dtype)
        scale = _check_scale(scale)
        stream_id, index = _stream_id(stream), _index(index)
        address = _Address(self._key, stream_id, index)
        pairs = (count + 1) // 2
        # one keystream buffer, reused by every piece (never handed out)
        scratch = bytearray(_PAIR_BYTES * min(pairs, _CHUNK_PAIRS) + 2 * _BLOCK_BYTES)
        for p0 in range(0, pairs, _CHUNK_PAIRS):
            p1 = min(pairs, p0 + _CHUNK_PAIRS)
            # fresh per piece: the sines are computed in place and handed out
            k = np.empty(p1 - p0, dtype=np.float64)
            j = np.empty(p1 - p0, dtype=np.float64)
            address.pairs_into(pairs, p0, p1, scratch, k=k, j=j)
            cos_part, sin_part = _box_muller(k, j, scale)
            yield p0, cos_part.to(dtype)
            kept = min(p1 - p0, count - pairs - p0)  # an odd count drops the last sine
            if kept > 0:
                yield pairs + p0, sin_part[:kept].to(dtype)

    def normal_range_pieces(
        self,
        stream: str,
        index: int,
        count: int,
        start: int,
        stop: int,
        *,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Positions ``[start, stop)`` of :meth:`normal_pieces`'s draw of ``count`` values, as
        ``(position, values)`` pieces (≤ 2¹⁷ values each): the same values bit for bit, and
        only the keystream of their pairs is read (pair ``i`` gives positions ``i`` and
        ``⌈count/2⌉ + i`` from its own words only).

        Example:
            >>> import torch
            >>> source = Randomness.seeded(0)
            >>> full = source.normal("noise", 0, 9, dtype=torch.float64)
            >>> part = torch.cat([v for _, v in source.normal_range_pieces(
            ...     "noise", 0, 9, 3, 7, dtype=torch.float64)])
            >>> torch.equal(part, full[3:7])
            True
        """
        dtype, scale = _normal_dtype(dtype), _check_scale(scale)
        if not 0 <= start <= stop <= count:
            raise ConfigurationError(
                f"start={start}, stop={stop}: expected 0 ≤ start ≤ stop ≤ count={count}"
            )
        address = _Address(self._key, _stream_id(stream), _index(index))
        pairs = (count + 1) // 2
        # (first pair, end pair, position of pair 0, cosine?) of each half
        runs = ((start, min(stop, pairs), 0, True), (start - pairs, stop - pairs, pairs, False))
        for lowest, last, base, cosine in runs:
            first = max(lowest, 0)
            if first >= last:
                continue
            scratch = bytearray(_PAIR_BYTES * min(last - first, _CHUNK_PAIRS) + 2 * _BLOCK_BYTES)
            for p0 in range(first, last, _CHUNK_PAIRS):
                p1 = min(last, p0 + _CHUNK_PAIRS)
                k = np.empty(p1 - p0, dtype=np.float64)
                j = np.empty(p1 - p0, dtype=np.float64)
                address.pairs_into(pairs, p0, p1, scratch, k=k, j=j)
                cos_part, sin_part = _box_muller(k, j, scale)
                yield base + p0, (cos_part if cosine else sin_part).to(dtype)

    def bernoulli(self, stream: str, index: int, count: int, p: float) -> np.ndarray:
        """``count`` independent Bernoulli(p) draws as a bool array (p within 2⁻⁶⁴)."""
        if not 0.0 <= p <= 1.0:
            raise ConfigurationError(f"p={p!r}: expected a probability in [0, 1]")
        if p == 1.0:
            return np.ones(count, dtype=bool)
        threshold = np.uint64(math.floor(Fraction(p) * 2**64))
        out = np.empty(count, dtype=bool)
        # in pieces, so a large dataset never holds all its words at once (same values)
        for start in range(0, count, _CHUNK_WORDS):
            stop = min(count, start + _CHUNK_WORDS)
            words = self.uint64(stream, index, stop - start, offset=start)
            np.less(words, threshold, out=out[start:stop])
        return out

    def sort_keys(self, stream: str, index: int, count: int) -> np.ndarray:
        """A uniformly random order of ``range(count)`` (argsort of random 64-bit keys)."""
        keys = self.uint64(stream, index, count)
        return np.argsort(keys, kind="stable")


def _normal_dtype(dtype: torch.dtype | None) -> torch.dtype:
    import torch

    if dtype is None:
        return torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise InputTypeError(f"dtype={dtype}: expected torch.float32 or torch.float64")
    return dtype


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputTypeError(f"scale={scale!r} ({type(scale).__name__}): expected a float")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ConfigurationError(f"scale={scale!r}: expected a finite standard deviation > 0")
    return value


def _box_muller(k: np.ndarray, j: np.ndarray, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``(r·cos θ, r·sin θ)`` in fp64 from ``k`` (63-bit integers) and ``j`` (signed 64-bit
    integers), both already converted to fp64, the radius multiplied by ``scale``; both arrays
    are consumed (computed in place: the radius is ``k``'s memory, the sines ``j``'s)."""
    import torch

    # u = (k + 1/2)·2^-63 with k uniform on [0, 2^63): u ∈ [2^-64, 1] (u = 1 gives radius -0.0)
    # torch's fp64 log and sqrt (SLEEF, within 1 ulp) run on torch's threads: at torch's
    # default 2 threads the log takes a quarter of numpy's single-threaded time
    radius = torch.from_numpy(k).mul_(2.0**-63).add_(2.0**-64)
    radius.log_().mul_(-2.0).sqrt_()
    if scale != 1.0:
        radius.mul_(scale)
    # θ = π·j·2^-63 with j a signed 64-bit integer: θ ∈ [-π, π]
    theta = torch.from_numpy(j).mul_(math.pi * 2.0**-63)
    return torch.cos(theta).mul_(radius), theta.sin_().mul_(radius)


@dataclass(frozen=True, slots=True)
class _Address:
    """One keystream: a key, a stream identifier and an index (what a draw reads)."""

    key: bytes
    stream_id: int
    index: int

    def span_into(self, start: int, stop: int, buf: bytearray, at: int) -> memoryview:
        """Keystream bytes ``[start, stop)`` (any byte offsets), written into ``buf`` from
        position ``at`` on (from the block holding ``start``); the returned view is them."""
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
        fp64 into ``k`` (the radius integers, 63 bits) and ``j`` (the angle integers, signed
        64 bits), read through ``buf`` (keystream scratch of ``16·(h1 - h0) + 128`` bytes: each
        span may start up to a block early). The radius words of all pairs come first, then
        their angle words."""
        n = h1 - h0
        radius = self.span_into(8 * h0, 8 * h1, buf, 0)
        angle = self.span_into(8 * pairs + 8 * h0, 8 * pairs + 8 * h1, buf, 8 * n + _BLOCK_BYTES)
        bits = np.frombuffer(radius, dtype="<u8")  # little-endian words on every platform
        np.bitwise_and(bits, _MASK63, out=bits)  # the top bit dropped, in the scratch
        np.copyto(k, bits.view("<i8"), casting="unsafe")  # as numpy's astype rounds
        np.copyto(j, np.frombuffer(angle, dtype="<i8"), casting="unsafe")


def _fill(key: bytes, stream_id: int, index: int, offset: int, out: memoryview) -> None:
    """Write the keystream of ``(stream_id, index)`` from byte ``offset`` (whole blocks) on
    into ``out``, reading through the shared zero buffer segment by segment."""
    if not len(out):
        return
    cipher = _cipher(key, stream_id, index, offset // _BLOCK_BYTES)
    step = len(_ZEROS)
    for start in range(0, len(out), step):  # the cipher's counter runs on between calls
        stop = min(len(out), start + step)
        cipher.update_into(_ZEROS[: stop - start], out[start:stop])


def check_seed(seed: object) -> int:
    """A seed is a non-negative int."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or int(seed) < 0:
        raise InputTypeError(f"seed={seed!r}: expected a non-negative int")
    return int(seed)


def _stream_id(stream: str) -> int:
    try:
        return STREAMS[stream]
    except KeyError:
        raise ConfigurationError(
            f"stream={stream!r}: expected one of {', '.join(sorted(STREAMS))}"
        ) from None


def _index(index: object) -> int:
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise InputTypeError(f"index={index!r}: expected an int")
    value = int(index)
    if not 0 <= value < 2**64:
        raise ConfigurationError(f"index={value}: expected 0 ≤ index < 2**64")
    return value
