"""Validation of :class:`~opake.dpsgd.optimizer.DPOptimizer`'s arguments.

Each function checks one group of constructor arguments and returns the normalised values, or
raises a typed :mod:`opake.core.errors` error saying what was wrong and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.noise import GaussianNoise


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(
            f"{name}={value!r} ({type(value).__name__}): expected a real number; pass a float"
        )
    number = float(value)
    if not number > 0.0 or not math.isfinite(number):
        raise ConfigurationError(f"{name}={value!r}: expected a finite number > 0")
    return number


def _sample_rate(value: object) -> float:
    rate = _positive_float("sample_rate", value)
    if rate > 1.0:
        raise ConfigurationError(
            f"sample_rate={value!r}: expected a probability in (0, 1]; pass q = expected batch "
            "size / dataset size"
        )
    return rate


def check_sampler_rate(bound: float | None, rate: float | None, what: str) -> None:
    """Refuse a rate other than ``bound``, the rate of the sampler a ``DPOptimizer`` was built
    from (``None``: no sampler): the accountant would record a q the batches are not drawn at
    and report a wrong ε.

    >>> check_sampler_rate(0.1, 0.1, "sample_rate")
    >>> check_sampler_rate(None, 0.5, "sample_rate")
    """
    if bound is None or (rate is not None and math.isclose(rate, bound, rel_tol=1e-12)):
        return
    raise ConfigurationError(
        f"{what}={rate!r}, but this DPOptimizer was built from a sampler that draws every batch "
        f"at q = {bound!r}: the accountant must record the rate the batches are drawn at. "
        "Build a new sampler (and optimizer) with the new rate, or build the optimizer without "
        "sampler= and account the rate yourself"
    )


def count_noise(noise: Any, step: int) -> float | None:
    """One standard normal value for adaptive clipping's count at logical step ``step``, from
    ``noise``'s random source (its stream ``"count"``: secure when the noise is), or ``None``
    when the noise object has no :class:`~opake.dpsgd.randomness.Randomness`. A secure source
    gives each step's value once (``Randomness.reserve``): asking again for a step already
    drawn (a clip state loaded from an earlier step) raises instead of releasing it twice.

    >>> from opake.dpsgd.noise import GaussianNoise
    >>> count_noise(GaussianNoise(1.0, seed=0), 3) == count_noise(GaussianNoise(2.0, seed=0), 3)
    True
    """
    import torch

    from opake.dpsgd.randomness import Randomness

    source = getattr(noise, "randomness", None)
    if not isinstance(source, Randomness):
        return None
    source.reserve("count", step)
    return float(source.normal("count", step, 1, dtype=torch.float64)[0])


def reserve_count(noise: Any, step: int) -> float:
    """Take count-noise index ``step`` of ``noise``'s secure source without drawing it (a rank
    whose value comes from rank 0's broadcast); returns 0.0, the placeholder it replaces."""
    from opake.dpsgd.randomness import Randomness

    source = getattr(noise, "randomness", None)
    if isinstance(source, Randomness):
        source.reserve("count", step)
    return 0.0


def _name_parameters(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor] | torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Name every tensor the optimizer updates, from a module or a ``name -> tensor`` dict."""
    import torch

    if isinstance(params, torch.nn.Module):
        named: Mapping[str, torch.Tensor] = dict(params.named_parameters())
    elif isinstance(params, Mapping):
        named = params
    else:
        raise InputTypeError(
            f"params={type(params).__name__}: expected the nn.Module or the name -> tensor dict "
            "(from make_functional) whose tensors the optimizer updates"
        )
    by_id: dict[int, str] = {}
    by_storage: dict[tuple[Any, ...], str] = {}
    for name, tensor in named.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InputTypeError(
                f"params has an entry {name!r}: {type(tensor).__name__}; expected str -> Tensor"
            )
        by_id.setdefault(id(tensor), name)
        if tensor.numel():
            by_storage.setdefault(_storage_key(tensor), name)
    names: dict[str, torch.Tensor] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            # the same tensor, or (make_functional's dicts) a detached alias of its storage
            found = by_id.get(id(p))
            if found is None and p.numel():
                found = by_storage.get(_storage_key(p))
            if found is None:
                raise ConfigurationError(
                    f"optimizer param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}) is not "
                    "one of the tensors in `params`; build the optimizer over the same tensors you "
                    "pass here (the module's parameters, or the dict from make_functional)"
                )
            if found in names:
                raise ConfigurationError(
                    f"parameter {found!r} appears twice in the optimizer's param_groups; list "
                    "each tensor once"
                )
            names[found] = p
    if not names:
        raise ConfigurationError("the optimizer has no parameters; nothing to train")
    return names


def _from_sampler(
    sampler: Any,
    *,
    expected_batch_size: float | None,
    sample_rate: float | None,
    max_batch_size: int | None,
    dataset_size: int | None,
    accounted: bool,
) -> tuple[float, float | None, int | None, int | None]:
    """Read the divisor and the accounting description from a Poisson sampler."""
    if getattr(sampler, "_kind", None) == "shuffle":
        rate_note = f" and sample_rate={sample_rate!r}" if sample_rate is not None else ""
        raise ConfigurationError(
            f"sampler=ShuffleSampler{rate_note}: shuffled fixed-size batches are not Poisson "
            "sampling, so they do not describe Poisson sampling and the ε of opake.accounting "
            "(the Poisson-subsampled Gaussian at rate q) does not hold for them — every example "
            "is in exactly one batch per epoch, and the amplification by subsampling that ε "
            "counts on is absent; a sample_rate would be accounted as if it were there. Use "
            "PoissonSampler or FixedShapePoissonSampler for private training"
        )
    if getattr(sampler, "_kind", None) == "unit_poisson":
        raise ConfigurationError(
            "sampler=UnitPoissonSampler: its ε holds per privacy unit only if each unit's "
            "gradient — the sum over all its records in the batch — is clipped to C as one, "
            "which DPOptimizer cannot see from the gradients it is given; train with "
            "DPTraining(privacy_units=...), which samples, clips and accounts by unit, or "
            "account yourself (DPOptimizer(sample_rate=sampler.sample_rate, "
            "expected_batch_size=sampler.expected_batch_size)) with "
            "grad_fn(..., units=sampler.units_of(batch))"
        )
    kwargs = getattr(sampler, "accounting_kwargs", None)
    expected = getattr(sampler, "expected_batch_size", None)
    if not isinstance(kwargs, Mapping) or not isinstance(expected, int | float):
        raise ConfigurationError(
            f"sampler={type(sampler).__name__} does not describe Poisson sampling (no "
            "expected_batch_size / accounting_kwargs): the accountant's ε assumes each example "
            "joins each batch independently with probability q, which this sampler does not "
            "say it does; use PoissonSampler or FixedShapePoissonSampler"
        )
    derived: dict[str, Any] = {"expected_batch_size": float(expected), **kwargs}
    if not accounted:
        derived = {k: v for k, v in derived.items() if k in ("expected_batch_size", "sample_rate")}
    given = {
        "expected_batch_size": expected_batch_size,
        "sample_rate": sample_rate,
        "max_batch_size": max_batch_size,
        "dataset_size": dataset_size,
    }
    for name, value in given.items():
        if value is None or name not in derived:
            continue
        if not math.isclose(float(value), float(derived[name]), rel_tol=1e-12):
            raise ConfigurationError(
                f"{name}={value!r} but the sampler has {name}={derived[name]!r}; drop the "
                "explicit value (the sampler's is the one the batches are drawn with)"
            )
    rate = derived.get("sample_rate", sample_rate)
    return (
        float(derived["expected_batch_size"]),
        rate if rate is None else float(rate),
        derived.get("max_batch_size", max_batch_size),
        derived.get("dataset_size", dataset_size),
    )


def _accounting_options(
    accountant: Any,
    *,
    count_noise_multiplier: float | None,
    max_batch_size: int | None,
    dataset_size: int | None,
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if count_noise_multiplier is not None:
        options["count_noise_multiplier"] = _positive_float(
            "count_noise_multiplier", count_noise_multiplier
        )
    if (max_batch_size is None) != (dataset_size is None):
        raise ConfigurationError(
            f"max_batch_size={max_batch_size!r}, dataset_size={dataset_size!r}: fixed-shape "
            "sampling is accounted from both; pass both or neither"
        )
    for name, value in (("max_batch_size", max_batch_size), ("dataset_size", dataset_size)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name}={value!r}: expected a positive int")
        options[name] = value
    if options and accountant is None:
        raise ConfigurationError(
            f"{', '.join(options)} given without an accountant: they only describe how steps "
            "are accounted; pass accountant= or drop them"
        )
    return options


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.dtype,
        tensor.data_ptr(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _default_noise(
    noise_multiplier: float, seed: int | None, secure: bool | None, randomness: Any
) -> GaussianNoise:
    from opake.dpsgd.noise import GaussianNoise

    return GaussianNoise(noise_multiplier, seed=seed, secure=secure, randomness=randomness)


def _divisor_and_rate(
    expected_batch_size: float | None, sample_rate: float | None, accountant: Any
) -> tuple[float, float | None]:
    """The divisor of the noisy sum and the rate q the accountant records (checked)."""
    if expected_batch_size is None:
        raise ConfigurationError(
            "no expected_batch_size: pass expected_batch_size=q·N (the divisor of the noisy "
            "sum) or the Poisson sampler as sampler="
        )
    divisor = _positive_float("expected_batch_size", expected_batch_size)
    rate = None if sample_rate is None else _sample_rate(sample_rate)
    if accountant is not None and rate is None:
        raise ConfigurationError(
            "accountant given without sample_rate: the accountant needs the Poisson rate q "
            "of each step; pass sample_rate=expected_batch_size / dataset_size"
        )
    if accountant is not None and not callable(getattr(accountant, "step", None)):
        raise InputTypeError(
            f"accountant={type(accountant).__name__}: expected an opake.accounting "
            "accountant (an object with step(noise_multiplier=, sample_rate=, num_steps=))"
        )
    return divisor, rate


def _check_delta(delta: float | None, accountant: Any) -> float | None:
    """δ of the ε reported with each step: only with an accountant, a probability in (0, 1)."""
    if delta is None:
        return None
    if accountant is None:
        raise ConfigurationError(
            f"delta={delta!r} without an accountant: ε can only be reported when an "
            "accountant records the steps; pass accountant= or drop delta"
        )
    delta = _positive_float("delta", delta)
    if delta >= 1.0:
        raise ConfigurationError(f"delta={delta!r}: expected a probability in (0, 1)")
    return delta


def _resolve_noise(
    noise: Any,
    noise_multiplier: float | None,
    *,
    seed: int | None,
    secure: bool | None,
    randomness: Any,
) -> Any:  # Any: the user's noise object is duck-typed (add() and noise_multiplier)
    """The noise object: the one given (checked against σ) or a default ``GaussianNoise``."""
    if noise is None:
        if noise_multiplier is None:
            raise ConfigurationError(
                "no noise_multiplier: pass noise_multiplier=σ (opake.accounting."
                "calibrate_noise picks σ for a target ε) or a GaussianNoise as noise="
            )
        sigma = _positive_float("noise_multiplier", noise_multiplier)
        return _default_noise(sigma, seed, secure, randomness)
    if seed is not None or secure is not None or randomness is not None:
        raise ConfigurationError(
            "noise= given together with seed=/randomness=/secure=: the random source "
            "is the noise object's; configure it there and drop them"
        )
    if not callable(getattr(noise, "add", None)) or not isinstance(
        getattr(noise, "noise_multiplier", None), int | float
    ):
        raise InputTypeError(
            f"noise={type(noise).__name__}: expected a GaussianNoise-like object with "
            "add(grads, sensitivity=) and a noise_multiplier"
        )
    if noise_multiplier is not None and not math.isclose(
        _positive_float("noise_multiplier", noise_multiplier), noise.noise_multiplier
    ):
        raise ConfigurationError(
            f"noise_multiplier={noise_multiplier!r} but noise= has noise_multiplier="
            f"{noise.noise_multiplier!r}; pass one of them (the noise object's σ is used)"
        )
    return noise
