"""Validation of :class:`~opake.dpsgd.training.DPTraining`'s arguments and the pieces built
from them (accountant, σ, fixed-shape bound, sampler).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from opake.core.choices import ACCOUNTANTS, ENGINES, SAMPLERS
from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    from opake.accounting import PrivacyAccountant
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, UnitPoissonSampler


@overload
def _positive(name: str, value: object, *, integer: Literal[True]) -> int: ...
@overload
def _positive(name: str, value: object, *, integer: Literal[False] = False) -> float: ...
def _positive(name: str, value: object, *, integer: bool = False) -> int | float:
    """``value`` as an int ≥ 1 (``integer``) or a finite float > 0, or a typed error."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int > 0")
        if int(value) < 1:
            raise ConfigurationError(f"{name}={value!r}: expected an int ≥ 1")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected a number > 0")
    number = float(value)
    if not (number > 0.0 and math.isfinite(number)):
        raise ConfigurationError(f"{name}={value!r}: expected a finite number > 0")
    return number


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigurationError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return str(value)


def _rate(expected: float | None, rate: float | None, n: int) -> float:
    if (expected is None) == (rate is None):
        raise ConfigurationError(
            "pass exactly one of expected_batch_size (q·N, global) and sample_rate (q)"
        )
    if expected is not None:
        b = _positive("expected_batch_size", expected)
        if b > n:
            raise ConfigurationError(
                f"expected_batch_size={expected!r} exceeds dataset_size={n}; the expected "
                "Poisson batch must be at most the dataset"
            )
        return float(b / n)
    q = _positive("sample_rate", rate)
    if q > 1.0:
        raise ConfigurationError(f"sample_rate={rate!r}: expected a probability in (0, 1]")
    return float(q)


def _make_accountant(accountant: Any, options: Mapping[str, Any] | None) -> PrivacyAccountant:
    from opake import accounting

    if isinstance(accountant, str):
        _choice("accountant", accountant, ACCOUNTANTS)
        return accounting.make_accountant(accountant, **dict(options or {}))
    if options:
        raise ConfigurationError(
            "accountant_options are for a named accountant; configure the accountant object"
        )
    if not isinstance(accountant, accounting.PrivacyAccountant):
        raise InputTypeError(
            f"accountant={type(accountant).__name__}: expected 'pld', 'rdp' or an "
            "opake.accounting accountant"
        )
    if accountant.steps:
        raise ConfigurationError(
            "the accountant already holds steps; pass a fresh one (resume with load())"
        )
    return accountant


def _check_delta(delta: object) -> float:
    value = float(_positive("delta", delta))
    if value >= 1.0:
        raise ConfigurationError(f"delta={value!r}: expected a probability in (0, 1)")
    return value


def _fixed_shape(
    sampler: str,
    max_batch_size: int | None,
    n: int,
    q: float,
    steps: int | None,
    *,
    delta: float,
    target: float | None,
) -> dict[str, Any]:
    """What the accountant records for fixed-shape sampling (``B_max`` and N); ``{}`` otherwise.

    Without ``max_batch_size``, ``B_max`` is chosen for the planned run with a truncation budget
    from ``truncation_budget_for(delta, target_epsilon)``.
    """
    from opake import accounting

    if sampler != "fixed":
        if max_batch_size is not None:
            raise ConfigurationError("max_batch_size is for sampler='fixed'; drop it or use it")
        return {}
    if max_batch_size is None:
        if steps is None:
            raise ConfigurationError(
                "sampler='fixed' without max_batch_size needs steps= (B_max is chosen "
                "for the planned run); pass max_batch_size or steps"
            )
        max_batch_size = min(
            n,
            accounting.max_batch_size_for(
                dataset_size=n,
                sample_rate=q,
                steps=steps,
                truncation_budget=accounting.truncation_budget_for(delta, target),
            ),
        )
    return {"max_batch_size": max_batch_size, "dataset_size": n}


def _calibrated_sigma(
    accountant: Any,
    plan: tuple[float | None, float | None, int | None, float],
    delta: float,
    extra: dict[str, Any],
    clip: object = None,
) -> float:
    """σ: the one given, or calibrated so that ``steps`` steps spend ``target_epsilon`` (with
    adaptive clipping's count noise, released at every step too, when ``clip`` has one);
    ``plan`` is ``(noise_multiplier, target_epsilon, steps, q)``."""
    from opake import accounting

    noise_multiplier, target_epsilon, steps, q = plan
    if noise_multiplier is not None:
        return float(_positive("noise_multiplier", noise_multiplier))
    if target_epsilon is None:
        raise ConfigurationError(
            "no noise: pass noise_multiplier=σ, or target_epsilon= with steps= to calibrate σ"
        )
    if steps is None:
        raise ConfigurationError(
            f"target_epsilon={target_epsilon!r} without noise_multiplier needs steps= (the "
            "planned number of logical steps) to calibrate σ"
        )
    kind = accountant.kind
    count_sigma = getattr(clip, "count_noise_multiplier", None)
    if count_sigma is not None:
        extra = {**extra, "count_noise_multiplier": count_sigma}
    return accounting.calibrate_noise(
        target_epsilon=_positive("target_epsilon", target_epsilon),
        delta=delta,
        sample_rate=q,
        steps=_positive("steps", steps, integer=True),
        accountant=kind,
        accountant_options=accountant.options(),
        **extra,
    )


def _make_sampler(
    kind: str,
    n: int,
    q: float,
    extra: Mapping[str, Any],
    context: Any,
    *,
    how: tuple[int | None, int | None, PrivacyUnits | None],
) -> PoissonSampler | FixedShapePoissonSampler | UnitPoissonSampler:
    """This rank's sampler of the global Poisson batches (of units, with ``privacy_units``);
    ``how``: ``(steps_per_epoch, seed, units)``.

    Secure (``seed=None``): batch membership from a key rank 0 drew and shared, never stored;
    an int seed: reproducible and not private.
    """
    steps_per_epoch, seed, units = how
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, UnitPoissonSampler

    keyed: dict[str, Any] = (
        {"randomness": context.shared_randomness()} if seed is None else {"seed": seed}
    )
    shard: dict[str, Any] = context.sampler_kwargs()
    if units is not None:
        return UnitPoissonSampler(
            units.keys,
            q,
            max_records_per_unit=units.cap,
            steps_per_epoch=steps_per_epoch,
            **keyed,
            **shard,
        )
    if kind == "fixed":
        return FixedShapePoissonSampler(
            n, q, extra["max_batch_size"], steps_per_epoch=steps_per_epoch, **keyed, **shard
        )
    return PoissonSampler(n, q, steps_per_epoch=steps_per_epoch, **keyed, **shard)


@dataclass(frozen=True)
class PrivacyUnits:
    """``DPTraining(privacy_units=..., max_records_per_unit=...)``, checked."""

    keys: Sequence[Hashable]
    count: int
    cap: int | None


def _check_privacy_units(
    keys: object, cap: object, n: int, sampler: object, world_size: int
) -> PrivacyUnits | None:
    """The unit of every record: as many as ``dataset_size``, Poisson sampling, one process."""
    if keys is None:
        if cap is not None:
            raise ConfigurationError(
                "max_records_per_unit without privacy_units: the cap counts one unit's records; "
                "pass privacy_units= (each record's unit) too"
            )
        return None
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InputTypeError(
            f"privacy_units={type(keys).__name__}: expected a sequence with each record's unit "
            "(a user id, a name), as long as dataset_size"
        )
    if len(keys) != n:
        raise ConfigurationError(
            f"privacy_units has {len(keys)} entries for dataset_size={n}: give each record's unit"
        )
    if sampler != "poisson":
        raise ConfigurationError(
            f"privacy_units with sampler={sampler!r}: units are drawn by Poisson sampling only "
            "(a unit brings a variable number of records); use sampler='poisson'"
        )
    if world_size > 1:
        raise ConfigurationError(
            f"privacy_units with {world_size} ranks: a unit's records on two ranks would be "
            "clipped separately, and batches are not sharded by unit yet; train in one process"
        )
    from opake.dpsgd.sampling._units import count_units

    count = count_units(keys)  # as the unit sampler groups them (by value)
    return PrivacyUnits(
        keys, count, None if cap is None else _positive("max_records_per_unit", cap, integer=True)
    )


def _rates_of(sampler: Any) -> dict[str, Any]:
    """How ``DistributedDPOptimizer`` learns the sampling: the sampler itself, or for a unit
    sampler its rate and divisor (DPOptimizer refuses a unit sampler, whose guarantee needs the
    per-unit clipping only DPTraining does)."""
    if getattr(sampler, "_kind", None) == "unit_poisson":
        return {
            "sample_rate": sampler.sample_rate,
            "expected_batch_size": sampler.expected_batch_size,
        }
    return {"sampler": sampler}


def _check_arguments(
    unknown: Mapping[str, Any],
    args: object,
    params: object,
    dataset_size: object,
    batch_args: object,
) -> tuple[int, int]:
    """Check ``DPTraining``'s keywords, fixed arguments and parameters; returns N and batch_args."""
    if unknown:
        raise ConfigurationError(
            f"DPTraining() got an unknown keyword argument {next(iter(unknown))!r}"
        )
    if not isinstance(args, tuple):
        raise InputTypeError(f"args={type(args).__name__}: expected a tuple")
    if not isinstance(params, Mapping) or not params:
        raise InputTypeError(
            f"params={type(params).__name__}: expected the non-empty name -> tensor dict of "
            "trainable tensors (make_functional(model, partition_trainable=True))"
        )
    n = _positive("dataset_size", dataset_size, integer=True)
    return n, _positive("batch_args", batch_args, integer=True)


def _check_sampler(sampler: object, *, sample_rate: object, expected_batch_size: object) -> None:
    """``sampler`` must name one of :data:`SAMPLERS`: DPTraining draws its own Poisson batches,
    the only sampling its accountant's ε is computed for. A sampler object (a
    ``ShuffleSampler``, a ``DataLoader``'s sampler) or another name is refused, whatever
    sampling rate comes with it."""
    if isinstance(sampler, str) and sampler in SAMPLERS:
        return
    given = repr(sampler) if isinstance(sampler, str) else type(sampler).__name__
    rate = "".join(
        f" with {name}={value!r}"
        for name, value in (
            ("sample_rate", sample_rate),
            ("expected_batch_size", expected_batch_size),
        )
        if value is not None
    )
    raise ConfigurationError(
        f"sampler={given}{rate}: expected one of {', '.join(map(repr, SAMPLERS))} — DPTraining "
        "draws its own Poisson batches, the only sampling its ε is computed for; a shuffle into "
        "batches of one size (ShuffleSampler, a DataLoader's sampler) is not Poisson sampling, "
        "whatever sample rate comes with it. Pass sampler='poisson' (or 'fixed': truncated "
        "Poisson in static shapes) and take each step's indices from training.batches()"
    )


def _check_choices(
    engine: object, sampler: object, seed: object, *, rates: tuple[object, object]
) -> None:
    """``rates``: ``(sample_rate, expected_batch_size)`` as given (quoted in a sampler refusal)."""
    _choice("engine", engine, ENGINES)
    _check_sampler(sampler, sample_rate=rates[0], expected_batch_size=rates[1])
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InputTypeError(f"seed={seed!r}: expected None (secure) or an int ≥ 0")


@overload
def _optional_positive(name: str, value: object, *, integer: Literal[True]) -> int | None: ...
@overload
def _optional_positive(
    name: str, value: object, *, integer: Literal[False] = False
) -> float | None: ...
def _optional_positive(name: str, value: object, *, integer: bool = False) -> int | float | None:
    """:func:`_positive`, ``None`` allowed."""
    if value is None:
        return None
    return _positive(name, value, integer=True) if integer else _positive(name, value)


def _accounting_of(sampler: Any, extra: Mapping[str, Any], clip_state: Any) -> dict[str, Any]:
    """What the accountant records with each step beside σ and q."""
    count_sigma = getattr(clip_state, "count_noise_multiplier", None)
    accounting = {**sampler.accounting_kwargs, **extra}
    if count_sigma is not None:
        accounting["count_noise_multiplier"] = count_sigma
    return accounting


def _check_new_params(
    old: Mapping[str, Any], old_args: tuple[Any, ...], params: object, args: object
) -> tuple[Any, ...]:
    """Check ``DPTraining.set_params``'s tensors against the old ones; returns the new args."""
    if not isinstance(params, Mapping) or set(params) != set(old):
        raise ConfigurationError(
            "set_params(): expected the same parameter names as at construction"
        )
    for name, value in params.items():
        if tuple(value.shape) != tuple(old[name].shape):
            raise ConfigurationError(
                f"set_params(): {name!r} has shape {tuple(value.shape)}, expected "
                f"{tuple(old[name].shape)}"
            )
    if args is None:
        return old_args
    if not isinstance(args, tuple) or len(args) != len(old_args):
        raise ConfigurationError(
            f"set_params(args=...): expected a tuple of {len(old_args)} argument(s)"
        )
    return args


def _physical_batch(item: object) -> tuple[tuple[Any, ...], Any, Any, Any]:
    """``(batched arguments, example_mask, units, records)`` of one physical batch of
    ``logical_step``: a tuple of batched arguments, or a dict ``{"args": (...),
    "example_mask": mask, "units": ids, "records": indices}`` (all but ``args`` optional)."""
    if isinstance(item, Mapping):
        extra = set(item) - {"args", "example_mask", "units", "records"}
        if extra or not isinstance(item.get("args"), tuple):
            raise ConfigurationError(
                "a physical batch dict holds 'args' (a tuple) and optionally "
                f"'example_mask', 'units' and 'records'; got keys {sorted(item)}"
            )
        return item["args"], item.get("example_mask"), item.get("units"), item.get("records")
    if isinstance(item, tuple):
        return item, None, None, None
    raise InputTypeError(
        f"physical batch {type(item).__name__}: expected a tuple of batched arguments"
    )


def check_count_seed(clip_state: object, secure: bool) -> None:
    """Refuse adaptive clipping with a public count-noise seed in a run with secure noise."""
    seed = getattr(clip_state, "seed", None)
    if (
        secure
        and getattr(clip_state, "count_noise_multiplier", None) is not None
        and seed is not None
    ):
        raise ConfigurationError(
            f"AdaptiveClipping(seed={seed}) in a run with secure noise: its count noise would "
            "come from that public seed, so whoever holds it (it is in every checkpoint) "
            "recovers each step's exact count from the clipping norms and the reported ε does "
            "not hold; drop seed= (the count noise then comes from the run's secure source), or "
            "seed the whole run (DPTraining(seed=...): reproducible, not private)"
        )


def step_count_noise(clip_state: object, optimizer: Any) -> float | None:
    """The ``unit_noise`` of an adaptive state's ``end_step`` (``None``: none needed)."""
    if getattr(clip_state, "count_noise_multiplier", None) is None:
        return None
    if getattr(clip_state, "seed", None) is not None:
        return None  # a seeded state (a seeded run) draws its own
    noise: float | None = optimizer.count_noise(int(getattr(clip_state, "step", 0)))
    return noise
