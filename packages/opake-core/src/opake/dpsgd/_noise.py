"""Gaussian noise for DP-SGD: N(0, σ²·S²) added once per logical step, in fp32 or wider.

Implementation module behind :mod:`opake.dpsgd.noise`.
"""

from __future__ import annotations

import base64
import math
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["GaussianNoise", "NoisyGrads", "add_noise"]

_STATE_VERSION = 1


class NoisyGrads(dict):  # type: ignore[type-arg]
    """``name -> tensor`` dict of noised gradient sums, with the noise actually used.

    Attributes:
        noise_multiplier: σ of this draw.
        sensitivity: the L2 sensitivity S the noise was calibrated to.
        noise_std: ``σ·S``, the standard deviation of the noise added to every coordinate.
        secure: whether the draw came from OS entropy (not reproducible).
    """

    noise_multiplier: float
    sensitivity: float
    noise_std: float
    secure: bool

    def __init__(
        self,
        values: Mapping[str, torch.Tensor],
        *,
        noise_multiplier: float,
        sensitivity: float,
        secure: bool,
    ) -> None:
        super().__init__(values)
        self.noise_multiplier = noise_multiplier
        self.sensitivity = sensitivity
        self.noise_std = noise_multiplier * sensitivity
        self.secure = secure

    def __reduce__(self) -> Any:
        return (
            _rebuild_noisy,
            (dict(self), self.noise_multiplier, self.sensitivity, self.secure),
        )


def _rebuild_noisy(
    values: dict[str, Any], noise_multiplier: float, sensitivity: float, secure: bool
) -> NoisyGrads:
    return NoisyGrads(
        values, noise_multiplier=noise_multiplier, sensitivity=sensitivity, secure=secure
    )


def _check_noise_multiplier(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(
            f"noise_multiplier={value!r} ({type(value).__name__}): expected a positive float σ"
        )
    sigma = float(value)
    if not math.isfinite(sigma) or sigma <= 0.0:
        raise ConfigurationError(
            f"noise_multiplier={value!r}: expected a finite σ > 0 (σ = 0 adds no noise and is not "
            "private; use opake.accounting.calibrate_noise to pick σ for a target ε)"
        )
    return sigma


def _resolve_sensitivity(grads: Mapping[str, Any], sensitivity: object) -> float:
    carried = getattr(grads, "max_norm", None)
    values: list[tuple[str, object]] = []
    if sensitivity is not None:
        values.append(("sensitivity", sensitivity))
    if carried is not None:
        values.append(("grads.max_norm", carried))
    if not values:
        raise ConfigurationError(
            "no sensitivity: pass sensitivity= (the L2 bound C of the summed clipped gradients) "
            "or the dict returned by clipped_grad's grad_fn, which carries max_norm"
        )
    resolved = []
    for name, value in values:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            raise InputTypeError(
                f"{name}={value!r} ({type(value).__name__}): expected a float"
            ) from err
        if not math.isfinite(number) or number <= 0.0:
            raise ConfigurationError(
                f"{name}={value!r}: expected a finite sensitivity > 0 (the clipping bound C "
                "divided by normalize_by)"
            )
        resolved.append(number)
    if len(resolved) == 2 and not math.isclose(resolved[0], resolved[1], rel_tol=1e-6):
        raise ConfigurationError(
            f"sensitivity={resolved[0]!r} disagrees with grads.max_norm={resolved[1]!r}: the noise "
            "must be calibrated to the bound the gradients were clipped to; drop sensitivity= "
            "and let the gradients carry it"
        )
    return resolved[0]


def _check_grads(grads: object) -> None:
    import torch

    if not isinstance(grads, Mapping):
        raise InputTypeError(
            f"grads={type(grads).__name__}: expected a name -> tensor dict (what clipped_grad's "
            "grad_fn returns)"
        )
    for name, value in grads.items():
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"grads[{name!r}]={type(value).__name__}: expected a torch.Tensor")
        if not value.is_floating_point():
            raise InputTypeError(
                f"grads[{name!r}] has dtype {value.dtype}: expected a real floating-point tensor"
            )


def _noise_dtype(value: torch.Tensor) -> torch.dtype:
    import torch

    return torch.float64 if value.dtype == torch.float64 else torch.float32


def _draw(
    grads: Mapping[str, torch.Tensor],
    std: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Noise every entry in sorted key order (so every rank with the same key draws the same)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name in sorted(grads):
        value = grads[name]
        dtype = _noise_dtype(value)
        noise = torch.randn(value.shape, generator=generator, device=generator.device, dtype=dtype)
        noise = noise.mul_(std).to(value.device)
        # the noise buffer becomes the result (one tensor per entry, never the caller's)
        out[name] = noise.add_(value.detach().to(dtype=dtype))
    return {name: out[name] for name in grads}


def _os_entropy_seed() -> int:
    return secrets.randbits(63)


def add_noise(
    grads: Mapping[str, torch.Tensor],
    *,
    noise_multiplier: float,
    sensitivity: float | None = None,
    generator: torch.Generator | None = None,
) -> NoisyGrads:
    """Add N(0, σ²·S²) to every tensor of ``grads``; return fp32 (fp64 stays fp64) tensors.

    ``S`` is ``sensitivity`` or, when omitted, ``grads.max_norm`` (what ``clipped_grad``'s
    result carries). Noise is drawn in sorted key order from ``generator``; without one, a
    fresh generator seeded from OS entropy is used (secure, not reproducible).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> out = add_noise({"w": torch.zeros(3, dtype=torch.bfloat16)}, noise_multiplier=2.0,
        ...                 sensitivity=0.5, generator=g)
        >>> out["w"].dtype, out.noise_std
        (torch.float32, 1.0)
    """
    import torch

    sigma = _check_noise_multiplier(noise_multiplier)
    _check_grads(grads)
    sens = _resolve_sensitivity(grads, sensitivity)
    secure = generator is None
    if generator is None:
        generator = torch.Generator().manual_seed(_os_entropy_seed())
    elif not isinstance(generator, torch.Generator):
        raise InputTypeError(
            f"generator={type(generator).__name__}: expected a torch.Generator or None"
        )
    noisy = _draw(grads, sigma * sens, generator)
    return NoisyGrads(noisy, noise_multiplier=sigma, sensitivity=sens, secure=secure)


class GaussianNoise:
    """The Gaussian mechanism of DP-SGD with an explicit, checkpointable random source.

    Args:
        noise_multiplier: σ; the noise added to a gradient *sum* of sensitivity S has standard
            deviation σ·S.
        seed: seed of the reproducible generator. ``None`` (and ``secure=False``) draws a seed
            from OS entropy once; it is kept in :meth:`state_dict`, so the run stays resumable.
            Every rank that uses the same seed (and device type) draws the same noise.
        secure: draw each call's noise from a generator freshly seeded with 63 bits of OS entropy
            (``secrets``): nothing stored lets anyone replay the noise, and runs are not
            reproducible. The sampler of each draw is still torch's floating-point Gaussian
            (Mersenne Twister on CPU, Philox on CUDA), not a cryptographic or exact discrete
            sampler; see ``docs/guide/privacy.md``.
        device: device of the generator (``"cpu"``, ``"cuda"``, ``"cuda:1"``…). ``None`` uses
            the device of the first gradient tensor seen. Noise is drawn there and moved to each
            gradient's device. CPU and CUDA generators draw different streams for one seed.

    Example:
        >>> import torch
        >>> noise = GaussianNoise(1.0, seed=0)
        >>> out = noise.add({"w": torch.zeros(2)}, sensitivity=0.5)
        >>> out.noise_std
        0.5
        >>> replay = GaussianNoise(1.0, seed=0).add({"w": torch.zeros(2)}, sensitivity=0.5)
        >>> torch.equal(out["w"], replay["w"])
        True
    """

    def __init__(
        self,
        noise_multiplier: float,
        *,
        seed: int | None = None,
        secure: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        self._noise_multiplier = _check_noise_multiplier(noise_multiplier)
        if not isinstance(secure, bool):
            raise InputTypeError(f"secure={secure!r}: expected True or False")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise InputTypeError(f"seed={seed!r} ({type(seed).__name__}): expected an int")
            if secure:
                raise ConfigurationError(
                    f"seed={seed} with secure=True: a secure generator takes its seed from OS "
                    "entropy on every call; drop seed= (or secure=True for a reproducible run)"
                )
            if not 0 <= seed < 2**64:
                raise ConfigurationError(f"seed={seed}: expected an int in [0, 2**64)")
        self._secure = secure
        self._seed = None if secure else (_os_entropy_seed() if seed is None else seed)
        self._device = None if device is None else _as_device(device)
        self._generator: torch.Generator | None = None
        self._calls = 0
        self.last_noise_std: float | None = None

    @property
    def noise_multiplier(self) -> float:
        """σ; settable between steps (e.g. a schedule), the accountant must be told too."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._noise_multiplier = _check_noise_multiplier(value)

    @property
    def secure(self) -> bool:
        """Whether each call draws from fresh OS entropy."""
        return self._secure

    @property
    def seed(self) -> int | None:
        """The seed of the reproducible generator (``None`` in secure mode)."""
        return self._seed

    @property
    def calls(self) -> int:
        """Number of :meth:`add` calls (logical steps noised) so far."""
        return self._calls

    def _generator_for(self, grads: Mapping[str, torch.Tensor]) -> torch.Generator:
        import torch

        if self._device is None:
            first = next(iter(grads.values()), None)
            self._device = first.device if first is not None else torch.device("cpu")
        if self._secure:
            return torch.Generator(device=self._device).manual_seed(_os_entropy_seed())
        if self._generator is None:
            assert self._seed is not None
            self._generator = torch.Generator(device=self._device).manual_seed(self._seed)
        return self._generator

    def add(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> NoisyGrads:
        """Return ``grads`` + N(0, σ²·S²) per coordinate, as fp32 (fp64 stays fp64) tensors.

        Call it exactly once per logical step, on the gradient sum over every microbatch and
        every rank. ``S`` is ``sensitivity`` or ``grads.max_norm``; if both are given they must
        agree. The returned dict carries ``noise_std`` (σ·S), also kept as
        :attr:`last_noise_std`.
        """
        _check_grads(grads)
        sens = _resolve_sensitivity(grads, sensitivity)
        generator = self._generator_for(grads)
        std = self._noise_multiplier * sens
        noisy = _draw(grads, std, generator)
        self._calls += 1
        self.last_noise_std = std
        return NoisyGrads(
            noisy, noise_multiplier=self._noise_multiplier, sensitivity=sens, secure=self._secure
        )

    __call__ = add

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: σ, seed, device and the generator's exact position.

        In secure mode no generator state exists (nothing could replay the noise): the state
        only records the configuration.
        """
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "noise_multiplier": self._noise_multiplier,
            "secure": self._secure,
            "seed": self._seed,
            "device": None if self._device is None else str(self._device),
            "calls": self._calls,
            "generator_state": None,
        }
        if self._generator is not None:
            raw = self._generator.get_state().numpy().tobytes()
            state["generator_state"] = base64.b64encode(raw).decode("ascii")
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output so the next draw equals the uninterrupted run's."""
        import torch

        if not isinstance(state, Mapping):
            raise InputTypeError(f"state={type(state).__name__}: expected a mapping")
        missing = {"version", "noise_multiplier", "secure", "seed", "device", "calls"} - set(state)
        if missing:
            raise ConfigurationError(
                f"noise state lacks {sorted(missing)}: pass GaussianNoise.state_dict()'s output"
            )
        if state["version"] != _STATE_VERSION:
            raise ConfigurationError(
                f"noise state version {state['version']!r}: this Opake reads {_STATE_VERSION}"
            )
        if bool(state["secure"]) != self._secure:
            raise ConfigurationError(
                f"noise state has secure={state['secure']} but this GaussianNoise has "
                f"secure={self._secure}; build it with the same mode"
            )
        self._noise_multiplier = _check_noise_multiplier(state["noise_multiplier"])
        self._seed = state["seed"]
        self._calls = int(state["calls"])
        self._device = None if state["device"] is None else _as_device(state["device"])
        self._generator = None
        encoded = state.get("generator_state")
        if encoded is not None:
            raw = bytearray(base64.b64decode(encoded))
            gen = torch.Generator(device=self._device if self._device is not None else "cpu")
            gen.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
            self._generator = gen

    def __repr__(self) -> str:
        mode = "secure" if self._secure else f"seed={self._seed}"
        return f"GaussianNoise(noise_multiplier={self._noise_multiplier}, {mode})"


def _as_device(device: object) -> torch.device:
    import torch

    try:
        return torch.device(device)  # type: ignore[call-overload,no-any-return]
    except (TypeError, RuntimeError) as err:
        raise InputTypeError(
            f"device={device!r}: expected a torch.device or a string like 'cpu' or 'cuda:0'"
        ) from err
