"""Which random source a sampler or noise object uses (``randomness=`` > ``seed=`` > secure)."""

from __future__ import annotations

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.randomness._source import Randomness, check_seed

__all__ = ["resolve_randomness"]


def resolve_randomness(
    randomness: object, seed: object, *, owner: str, secure: object = None
) -> Randomness:
    """The source a sampler or noise object uses: ``randomness=`` > ``seed=`` > a fresh secure
    key. ``secure=True`` (the default behaviour) may not be combined with a seed; ``secure=False``
    needs one (seeded randomness is always explicit)."""
    if secure is not None and not isinstance(secure, bool):
        raise InputTypeError(f"{owner}: secure={secure!r}; expected True, False or None")
    if randomness is not None:
        if not isinstance(randomness, Randomness):
            raise InputTypeError(
                f"{owner}: randomness={type(randomness).__name__}; expected an "
                "opake.dpsgd.randomness.Randomness (Randomness.secure() or Randomness.seeded(n))"
            )
        if seed is not None:
            raise ConfigurationError(
                f"{owner}: randomness= and seed= both given; pass one (seed=n is "
                "Randomness.seeded(n))"
            )
        if secure is not None and secure != randomness.is_secure:
            raise ConfigurationError(
                f"{owner}: secure={secure} but randomness= is {randomness.mode}; drop secure="
            )
        return randomness
    if seed is not None:
        if secure:
            raise ConfigurationError(
                f"{owner}: seed={seed!r} with secure=True: a secure source takes its key from "
                "the operating system; drop seed= (or drop secure= for a reproducible, "
                "non-private run)"
            )
        return Randomness.seeded(check_seed(seed))
    if secure is False:
        raise ConfigurationError(
            f"{owner}: secure=False without a seed: reproducible randomness must be asked for "
            "explicitly with seed=<int> (and is not private); drop secure= for the secure default"
        )
    return Randomness.secure()
