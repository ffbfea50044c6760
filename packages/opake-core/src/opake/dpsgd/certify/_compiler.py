"""The compiler settings the clipping proof needs when Inductor compiles its arithmetic.

The proof's floating-point model (:mod:`._float`) is IEEE-754 arithmetic, fused multiply-adds
included (one rounding instead of two: a special case of the two operations' bound). Unsafe
math optimisations — reassociation, approximate reciprocals, ``-ffinite-math-only``'s
assumption that no value is NaN or infinite — are outside it: under ``-ffast-math`` the
compiled step drops its non-finite checks and a NaN reaches the clipped sum.
:func:`ieee_compile_options` is what every ``torch.compile`` of the clipping arithmetic passes
as ``options=``: it pins the flags Inductor's own configuration controls, and refuses compiler
settings that would append others (``TORCHINDUCTOR_CPP_MARCH``, ``CXX``, a flag inside any
Inductor setting such as ``aot_inductor.custom_op_libs``). A compiler that does
not honour its flags (a wrapper script that adds ``-ffast-math``) is outside the proof.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["ieee_compile_options"]

#: an architecture name, as ``-march=`` takes it (``native``, ``x86-64-v3``, ``armv8.6-a+sve``)
_ARCH = re.compile(r"[A-Za-z0-9_.+][A-Za-z0-9_.+-]*")
#: a command-line flag inside a setting (``"m -ffast-math"``, ``"O1 --fast-math"``)
_FLAG = re.compile(r"(^|\s)-{1,2}[A-Za-z]")
#: what an ``*opt_level`` setting may hold: an optimisation level alone (not ``-Ofast``)
_OPT_LEVEL = re.compile(r"-?O[0-3sz]?")


def _strings(value: object) -> list[str]:
    """The strings inside a configuration value (nested lists, tuples, sets, dicts)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return [text for item in value for text in _strings(item)]
    return []


def _injected(config: dict[str, Any]) -> list[str]:
    """The Inductor settings whose strings carry compiler flags of their own (every build's
    command line is split on whitespace, so a flag inside any string becomes a flag)."""
    bad = []
    for key, value in config.items():
        for text in _strings(value):
            allowed = key.endswith("opt_level") and _OPT_LEVEL.fullmatch(text)
            if not allowed and (key.endswith("opt_level") or _FLAG.search(text)):
                bad.append(f"{key} = {text!r}")
    return bad


def _check_toolchain(march: object, cxx: object) -> None:
    """Refuse compiler settings that smuggle flags into Inductor's C++ builds."""
    if march not in (None, "") and not (isinstance(march, str) and _ARCH.fullmatch(march)):
        raise ConfigurationError(
            f"torch._inductor.config.cpp.march = {march!r} (TORCHINDUCTOR_CPP_MARCH) is not an "
            "architecture name: it adds compiler flags to every Inductor build, and Opake's "
            "compiled clipping arithmetic needs IEEE semantics (no -ffast-math). Set it to an "
            "architecture name alone (e.g. native), or unset it"
        )
    compilers = cxx if isinstance(cxx, tuple | list) else (cxx,)
    for compiler in compilers:
        if compiler is None:
            continue
        words = shlex.split(compiler) if isinstance(compiler, str) else None
        if words is None or len(words) != 1:
            raise ConfigurationError(
                f"torch._inductor.config.cpp.cxx holds {compiler!r} (CXX): not one compiler "
                "path. Flags given with the compiler reach every Inductor build, and Opake's "
                "compiled clipping arithmetic needs IEEE semantics (no -ffast-math). Set CXX to "
                "the compiler alone"
            )


def ieee_compile_options() -> dict[str, Any]:
    """The Inductor settings (``torch.compile(options=...)``) every compiled evaluation of the
    clipping arithmetic pins, whatever the environment or ``torch._inductor.config`` set: no
    unsafe math optimisations and no floating-point contraction in Inductor's C++ code
    (contraction is inside the proof's model; it is pinned off to match the proof's page).

    Raises:
        ConfigurationError: Inductor's compiler settings append flags of their own
            (``cpp.march`` that is not an architecture name, ``cpp.cxx`` with arguments, a
            flag inside any other setting, an ``*opt_level`` that is not a plain level).

    >>> sorted(ieee_compile_options())
    ['cpp.enable_floating_point_contract_flag', 'cpp.enable_unsafe_math_opt_flag']
    """
    import torch._inductor.config as inductor

    _check_toolchain(inductor.cpp.march, inductor.cpp.cxx)
    bad = _injected(inductor.get_config_copy())
    if bad:
        raise ConfigurationError(
            "Inductor settings carry compiler flags of their own, which reach every C++ build: "
            f"{'; '.join(bad)}. Opake's compiled clipping arithmetic needs IEEE semantics (no "
            "-ffast-math, -Ofast, -ffinite-math-only); remove the flags from these settings "
            "(or the environment variables that set them)"
        )
    return {
        "cpp.enable_unsafe_math_opt_flag": False,
        "cpp.enable_floating_point_contract_flag": "off",
    }
