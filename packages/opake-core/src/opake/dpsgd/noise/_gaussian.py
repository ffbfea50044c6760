"""Gaussian noise for DP-SGD: N(0, σ²·S²) added once per logical step, in fp32 or wider.

Implementation module behind :mod:`opake.dpsgd.noise`.

The secure (and seeded) path draws the noise in fp64 and returns
``Λ·rint(fl64(x/Λ + η/Λ))`` rounded once to the result's dtype, with ``Λ`` a power of two fixed
by ``σ·S`` alone (:func:`noise_grid`): a fixed function of the exact sum ``x + η``, so the set
of values a result can take does not depend on ``x`` (``docs/guide/privacy-noise.md``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.noise._checks import (
    as_device,
    check_grads,
    check_noise_multiplier,
    resolve_sensitivity,
)
from opake.dpsgd.noise._noisy import NoisyGrads
from opake.dpsgd.noise._rows import NoiseRows
from opake.dpsgd.randomness._resolve import resolve_randomness
from opake.dpsgd.randomness._source import Randomness, check_seed

if TYPE_CHECKING:
    import torch

__all__ = ["GaussianNoise", "NoisyGrads", "add_noise", "noise_grid"]

_STATE_VERSION = 2
#: the lattice is 2^-_GRID_BITS of the binade of σ·S: half the fp32 spacing at σ·S
_GRID_BITS = 24
#: σ·S in [2^-_STD_EXPONENT, 2^_STD_EXPONENT] keeps x/Λ a normal fp64 number (so exact) for
#: every non-zero fp32 x
_STD_EXPONENT = 800


def _noise_dtype(value: torch.Tensor) -> torch.dtype:
    import torch

    return torch.float64 if value.dtype == torch.float64 else torch.float32


def noise_grid(noise_std: float) -> float:
    """The lattice ``Λ`` secure noise rounds every noised value to: ``2^(⌊log2 σS⌋ − 24)``.

    A power of two fixed by the noise's standard deviation ``noise_std`` (σ·S) alone, never by
    the gradients: half the fp32 spacing at σ·S, so it removes no precision an fp32 value of
    the noise's size carries. :class:`GaussianNoise` and :func:`add_noise` (without
    ``generator=``) return ``Λ·rint(fl64(x/Λ + η/Λ))`` rounded once to the result's dtype, a
    fixed function of the exact sum ``x + η``: which values a result can take does not depend
    on ``x`` (see the guide's page "Noise in floating point").

    Example:
        >>> noise_grid(1.0) == 2.0**-24, noise_grid(0.75) == 2.0**-25
        (True, True)
    """
    if isinstance(noise_std, bool) or not isinstance(noise_std, int | float):
        raise InputTypeError(
            f"noise_std={noise_std!r} ({type(noise_std).__name__}): expected a float σ·S"
        )
    std = float(noise_std)
    if not math.isfinite(std) or not 2.0**-_STD_EXPONENT <= std <= 2.0**_STD_EXPONENT:
        raise ConfigurationError(
            f"noise_std={noise_std!r}: expected σ·S in [2^-{_STD_EXPONENT}, 2^{_STD_EXPONENT}] "
            "(gradients divided by the noise's lattice must stay normal fp64 numbers)"
        )
    _, exponent = math.frexp(std)  # std = m·2^exponent with m ∈ [0.5, 1)
    return math.ldexp(1.0, exponent - 1 - _GRID_BITS)


def _draw_torch(
    grads: Mapping[str, torch.Tensor],
    std: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Noise from a caller's ``torch.Generator`` (explicitly seeded; not private)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name in sorted(grads):
        value = grads[name]
        dtype = _noise_dtype(value)
        noise = torch.randn(value.shape, generator=generator, device=generator.device, dtype=dtype)
        noise = noise.mul_(std).to(value.device)
        out[name] = noise.add_(value.detach().to(dtype=dtype))
    return {name: out[name] for name in grads}


def _draw(
    grads: Mapping[str, torch.Tensor],
    std: float,
    source: Randomness,
    index: int,
    *,
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """Noise every entry from one keystream of ``source`` at ``index``, in sorted key order
    (so every rank with the same key draws the same), generated on the CPU in bounded pieces
    (no model-sized keystream or flat copy), and snapped onto the lattice of ``std``
    (:func:`_snap_add_`). The result is each entry itself (``in_place``) or a fresh copy of it
    in its noise dtype: the same values either way."""
    import torch

    names = sorted(grads)
    if in_place:
        results = {name: grads[name] for name in names}
    else:
        results = {name: _working_copy(grads[name]) for name in names}
    targets = [results[name].detach().view(-1) for name in names]
    ends = list(itertools.accumulate(t.numel() for t in targets))
    total = ends[-1] if ends else 0
    grid = noise_grid(std)
    # the noise in units of the lattice: std/grid is exact (a power-of-two ratio)
    pieces = source.normal_pieces("noise", index, total, dtype=torch.float64, scale=std / grid)
    for start, units in pieces:
        _scatter(units, start, targets, ends, grid)
    return {name: results[name] for name in grads}


def _working_copy(value: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of ``value`` in its noise dtype, on its device."""
    import torch

    out = torch.empty(value.shape, dtype=_noise_dtype(value), device=value.device)
    return out.copy_(value.detach())


def _snap_add_(dest: torch.Tensor, units: torch.Tensor, grid: float) -> None:
    """``dest ← Λ·rint(fl64(dest/Λ + units))`` rounded once to ``dest``'s dtype; ``units`` (fp64
    noise in lattice units, consumed) holds the intermediate.

    ``dest/Λ`` is exact (Λ a power of two) and IEEE addition rounds the exact sum, so the
    result is a fixed function of the exact real ``x + Λ·units``: its possible values (and the
    grid they lie on) do not depend on ``x``. Separate kernels, so no fused multiply-add can
    change a rounding between devices."""
    import torch

    if units.device != dest.device:
        units = units.to(dest.device)
    units.add_(dest, alpha=1.0 / grid)  # x/Λ exactly, then one rounding of the sum
    units.round_()  # to an integer, half to even
    torch.mul(units, grid, out=dest)  # exact, then one rounding to dest's dtype


def _scatter(
    values: torch.Tensor,
    start: int,
    targets: list[torch.Tensor],
    ends: list[int],
    grid: float,
) -> None:
    """Snap-add ``values`` (noise in lattice units) into flat positions ``start...`` of the
    targets laid end to end, each target on its own device and in its own dtype."""
    j = bisect.bisect_right(ends, start)
    done = 0
    while done < values.numel():
        begin = ends[j] - targets[j].numel()
        at = start + done - begin
        n = min(values.numel() - done, targets[j].numel() - at)
        _snap_add_(targets[j][at : at + n], values[done : done + n], grid)
        done += n
        j += 1


def add_noise(
    grads: Mapping[str, torch.Tensor],
    *,
    noise_multiplier: float,
    sensitivity: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> NoisyGrads:
    """Add N(0, σ²·S²) to every tensor of ``grads``; return fp32 (fp64 stays fp64) tensors.

    ``S`` is ``sensitivity`` or, when omitted, ``grads.max_norm`` (what ``clipped_grad``'s
    result carries). By default the noise comes from a fresh cryptographically secure source
    (:meth:`~opake.dpsgd.randomness.Randomness.secure`). ``seed=`` (a ChaCha20 key derived from
    it) or ``generator=`` (your own ``torch.Generator``) make it reproducible, and **not
    private**: whoever knows the seed or the generator state can subtract the noise. Without
    ``generator=`` each value is ``x`` plus fp64 noise rounded once onto :func:`noise_grid`'s
    lattice (``generator=`` adds ``torch.randn`` noise in the result's dtype).

    Example:
        >>> import torch
        >>> out = add_noise({"w": torch.zeros(3, dtype=torch.bfloat16)}, noise_multiplier=2.0,
        ...                 sensitivity=0.5)
        >>> out["w"].dtype, out.noise_std, out.secure
        (torch.float32, 1.0, True)
    """
    import torch

    sigma = check_noise_multiplier(noise_multiplier)
    check_grads(grads)
    sens = resolve_sensitivity(grads, sensitivity)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise InputTypeError(
                f"generator={type(generator).__name__}: expected a torch.Generator or None"
            )
        if seed is not None:
            raise ConfigurationError("seed= and generator= both given; pass one of them")
        noisy = _draw_torch(grads, sigma * sens, generator)
        return NoisyGrads(noisy, noise_multiplier=sigma, sensitivity=sens, secure=False)
    source = resolve_randomness(None, seed, owner="add_noise")
    noisy = _draw(grads, sigma * sens, source, 0)
    return NoisyGrads(noisy, noise_multiplier=sigma, sensitivity=sens, secure=source.is_secure)


class GaussianNoise:
    """The Gaussian mechanism of DP-SGD with an explicit, cryptographically secure source.

    Args:
        noise_multiplier: σ; the noise added to a gradient *sum* of sensitivity S has standard
            deviation σ·S.
        seed: ask for **reproducible, non-private** noise: the ChaCha20 key is derived from
            this integer, so the noise of every call is a function of ``(seed, call number)``
            and anyone who knows the seed can replay it. Without it (the default) the key is
            256 bits from the operating system, never stored.
        randomness: an explicit :class:`~opake.dpsgd.randomness.Randomness` (e.g. a secure key
            shared by the ranks of one run); exclusive with ``seed``.
        secure: accepted for compatibility: ``True`` is the default behaviour (and refuses a
            seed); ``False`` requires ``seed``.
        device: accepted for compatibility. Noise is generated on the CPU in fp64, moved to
            each gradient's device, added there in fp64 and rounded once onto the lattice
            :func:`noise_grid` (then to the result's dtype).

    Each :meth:`add` draws from the keystream at index :attr:`calls`, so a seeded source
    resumes bit for bit from :meth:`state_dict` (which holds the seed and the call count,
    never a secure key), and ranks sharing a key draw the same noise.

    Example:
        >>> import torch
        >>> noise = GaussianNoise(1.0, seed=0)
        >>> out = noise.add({"w": torch.zeros(2)}, sensitivity=0.5)
        >>> out.noise_std, noise.mode
        (0.5, 'seeded (not private)')
        >>> replay = GaussianNoise(1.0, seed=0).add({"w": torch.zeros(2)}, sensitivity=0.5)
        >>> torch.equal(out["w"], replay["w"])
        True
        >>> GaussianNoise(1.0).mode
        'secure'
    """

    def __init__(
        self,
        noise_multiplier: float,
        *,
        seed: int | None = None,
        randomness: Randomness | None = None,
        secure: bool | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self._noise_multiplier = check_noise_multiplier(noise_multiplier)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InputTypeError(f"seed={seed!r} ({type(seed).__name__}): expected an int")
        self._source = resolve_randomness(randomness, seed, owner="GaussianNoise", secure=secure)
        self._device = None if device is None else as_device(device)
        self._calls = 0
        self.last_noise_std: float | None = None

    @property
    def noise_multiplier(self) -> float:
        """σ; settable between steps (e.g. a schedule), the accountant must be told too."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._noise_multiplier = check_noise_multiplier(value)

    @property
    def secure(self) -> bool:
        """Whether the key came from the operating system (nothing stored can replay it)."""
        return self._source.is_secure

    @property
    def seed(self) -> int | None:
        """The seed of reproducible noise (``None`` when secure)."""
        return self._source.seed

    @property
    def randomness(self) -> Randomness:
        """The random source the noise is drawn from."""
        return self._source

    @property
    def mode(self) -> str:
        """``"secure"`` or ``"seeded (not private)"``."""
        return self._source.mode

    @property
    def calls(self) -> int:
        """Number of :meth:`add` calls (logical steps noised) so far."""
        return self._calls

    def add(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> NoisyGrads:
        """Return ``grads`` + N(0, σ²·S²) per coordinate, as fp32 (fp64 stays fp64) tensors.

        Call it exactly once per logical step, on the gradient sum over every microbatch and
        every rank. ``S`` is ``sensitivity`` or ``grads.max_norm``; if both are given they must
        agree. The returned dict carries ``noise_std`` (σ·S), also kept as
        :attr:`last_noise_std`.
        """
        check_grads(grads)
        sens = resolve_sensitivity(grads, sensitivity)
        std = self._noise_multiplier * sens
        noisy = _draw(grads, std, self._source, self._take())
        self.last_noise_std = std
        return NoisyGrads(
            noisy, noise_multiplier=self._noise_multiplier, sensitivity=sens, secure=self.secure
        )

    __call__ = add

    def add_(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> NoisyGrads:
        """:meth:`add` in place: the same draw, added to each tensor of ``grads`` itself.

        For accumulators you own (what :class:`~opake.dpsgd.optimizer.DPOptimizer` does with
        its gradient sum): no second gradient-sized buffer. Each tensor must be contiguous
        fp32 or fp64 (the dtypes :meth:`add` returns); the result holds the same tensors.

        Example:
            >>> import torch
            >>> sums = {"w": torch.zeros(2)}
            >>> out = GaussianNoise(1.0, seed=0).add_(sums, sensitivity=0.5)
            >>> out["w"] is sums["w"], torch.equal(
            ...     sums["w"], GaussianNoise(1.0, seed=0).add({"w": torch.zeros(2)}, 0.5)["w"])
            (True, True)
        """
        import torch

        check_grads(grads)
        for name, value in grads.items():
            if value.dtype not in (torch.float32, torch.float64) or not value.is_contiguous():
                layout = "contiguous" if value.is_contiguous() else "non-contiguous"
                raise InputTypeError(
                    f"GaussianNoise.add_: grads[{name!r}] is a {layout} {value.dtype} tensor; "
                    "in-place noise needs contiguous fp32 or fp64 accumulators (use add() for "
                    "other tensors)"
                )
        sens = resolve_sensitivity(grads, sensitivity)
        std = self._noise_multiplier * sens
        noisy = _draw(grads, std, self._source, self._take(), in_place=True)
        self.last_noise_std = std
        return NoisyGrads(
            noisy, noise_multiplier=self._noise_multiplier, sensitivity=sens, secure=self.secure
        )

    def draw_rows(self, shapes: Mapping[str, Sequence[int]], sensitivity: float) -> NoiseRows:
        """This call's noise on zero tensors of ``shapes``, drawn a row range at a time.

        Counts as one :meth:`add` call (the same index, σ·S and :attr:`last_noise_std`):
        ``draw_rows(shapes, S).rows(name, a, b)`` equals rows ``a:b`` of
        ``add({n: torch.zeros(s) for n, s in shapes.items()}, S)[name]`` bit for bit, and
        generates only those elements — each rank of a sharded run draws its own rows of the
        one global draw (disjoint rows get independent noise, shared rows the same).

        Example:
            >>> import torch
            >>> shapes = {"b": (3,), "w": (4, 2)}
            >>> part = GaussianNoise(1.0, seed=0).draw_rows(shapes, 0.5).rows("w", 1, 3)
            >>> full = GaussianNoise(1.0, seed=0).add({n: torch.zeros(s) for n, s in
            ...                                        shapes.items()}, 0.5)
            >>> torch.equal(part, full["w"][1:3])
            True
        """
        sens = resolve_sensitivity({}, sensitivity)
        std = self._noise_multiplier * sens
        noise_grid(std)  # the same checks as add()
        rows = NoiseRows(shapes, std=std, source=self._source, index=self._take())
        self.last_noise_std = std
        return rows

    def _take(self) -> int:
        """The index of this call's draw, reserved on the source (a secure source refuses one
        another consumer of its key has drawn: :meth:`Randomness.reserve`)."""
        index = self._calls
        self._source.reserve("noise", index)
        self._calls += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: σ, the mode, the seed (seeded only) and the call count.

        A secure key is never part of the state: nothing saved can replay the noise, and a
        resumed secure run continues with its own fresh key.
        """
        return {
            "version": _STATE_VERSION,
            "noise_multiplier": self._noise_multiplier,
            "secure": self.secure,
            "seed": self.seed,
            "calls": self._calls,
        }

    def check_state(self, state: Mapping[str, Any]) -> tuple[float, int]:
        """Validate *state* for :meth:`load_state_dict` without changing anything; return its
        ``(noise_multiplier, calls)``.

        Refused: a malformed or foreign state, a seeded state into a secure source (or the
        reverse), and — for a secure source that has already drawn — a state from an earlier
        call: the source keeps its key, so it would draw released noise again. A caller that
        restores several objects checks them all first (nothing half-applied).

        >>> noise = GaussianNoise(1.0, seed=0)
        >>> noise.check_state(GaussianNoise(2.0, seed=0).state_dict())
        (2.0, 0)
        """
        if not isinstance(state, Mapping):
            raise InputTypeError(f"state={type(state).__name__}: expected a mapping")
        missing = {"version", "noise_multiplier", "secure", "seed", "calls"} - set(state)
        if missing:
            raise ConfigurationError(
                f"noise state lacks {sorted(missing)}: pass GaussianNoise.state_dict()'s output"
            )
        if state["version"] != _STATE_VERSION:
            raise ConfigurationError(
                f"noise state version {state.get('version')!r}: this Opake reads "
                f"{_STATE_VERSION} (noise is now drawn from ChaCha20; restart the run, or "
                "resume it with the Opake version that saved it)"
            )
        if bool(state["secure"]) != self.secure:
            raise ConfigurationError(
                f"noise state is {'secure' if state['secure'] else 'seeded'} but this "
                f"GaussianNoise is {self.mode}; build it the same way (seed= for a seeded run, "
                "no seed for a secure one)"
            )
        calls = state["calls"]
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ConfigurationError(f"noise state calls={calls!r}: expected an int ≥ 0")
        sigma = check_noise_multiplier(state["noise_multiplier"])
        drawn = max(self._calls, self._source.next_free("noise"))
        if self.secure and calls < drawn:
            raise ConfigurationError(
                f"noise state calls={calls} into a secure GaussianNoise whose key has already "
                f"given {drawn} draws: it would draw the noise of calls {calls}..{drawn - 1} "
                "again — noise already released, which two outputs would cancel. Load the "
                "state into a new GaussianNoise (a new optimizer or DPTraining) built without "
                "this randomness=: it draws a fresh secure key"
            )
        if not self.secure:
            check_seed(state["seed"])
        return sigma, calls

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: a seeded source continues exactly where it
        stopped (the next draw equals the uninterrupted run's); a secure one keeps its own key
        and continues the call count — never backwards (that would draw released noise again:
        refused, load into a new object). The checks are :meth:`check_state`'s."""
        sigma, calls = self.check_state(state)
        if not self.secure:
            self._source = Randomness.seeded(check_seed(state["seed"]))
        self._noise_multiplier = sigma
        self._calls = calls

    def __repr__(self) -> str:
        mode = "secure" if self.secure else f"seed={self.seed}"
        return f"GaussianNoise(noise_multiplier={self._noise_multiplier}, {mode})"
