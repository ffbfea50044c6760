"""The conformance suite a model-family plugin runs against itself.

Every check builds two models from the plugin's factory — one patched through
:func:`opake.patches.apply_model_patches`, one never patched — and compares the patched model
under ``vmap`` with the trusted oracle: a per-example loop of plain autograd on the unpatched
model (:func:`opake.core.testing.per_example_grads_loop`). Inputs carry a 2-D padding mask
(right and left padding), as real batches do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opake.core.errors import ConfigurationError
from opake.models.testing._case import (
    ConformanceCase,
    ConformanceError,
    assert_grads_close,
)
from opake.models.testing._checks_grads import (
    check_clipped_grads,
    check_loss_only,
    check_outputs_match,
    check_per_example_grads,
    check_registered,
    check_unbatched_calls,
)
from opake.models.testing._checks_model import (
    check_checkpointing,
    check_dropout,
    check_instance_only,
    check_lora,
    check_reversible,
)

__all__ = [
    "CHECKS",
    "ConformanceCase",
    "ConformanceError",
    "assert_grads_close",
    "run_check",
    "run_family_conformance",
]


#: name → check, in the order :func:`run_family_conformance` runs them
CHECKS: dict[str, Callable[[ConformanceCase], None]] = {
    "registered": check_registered,
    "outputs_match": check_outputs_match,
    "loss_only": check_loss_only,
    "per_example_grads": check_per_example_grads,
    "clipped_grads": check_clipped_grads,
    "unbatched_calls": check_unbatched_calls,
    "checkpointing": check_checkpointing,
    "lora": check_lora,
    "dropout": check_dropout,
    "reversible": check_reversible,
    "instance_only": check_instance_only,
}


def run_check(name: str, case: ConformanceCase) -> None:
    """Run one check by name; raises :class:`ConformanceError` on failure.

    For pytest: ``@pytest.mark.parametrize("check", CHECKS)`` then ``run_check(check, case)``.
    """
    if name not in CHECKS:
        raise ConfigurationError(f"unknown conformance check {name!r}; known: {list(CHECKS)}.")
    CHECKS[name](case)


def run_family_conformance(
    make_model: Callable[[], Any],
    *,
    checks: Iterable[str] | None = None,
    **case_options: Any,
) -> dict[str, str]:
    """Run the conformance checks on a family's tiny model; raise if any fails.

    Args:
        make_model: zero-argument factory of a tiny task model (same weights on every call).
        checks: names from :data:`CHECKS` (default: all).
        **case_options: :class:`ConformanceCase` fields (``kernels``, ``batch``, ``seq``,
            ``rtol``, ``lora_targets``, ``seed``).

    Returns:
        check name → ``"ok"``. Every check runs; a :class:`ConformanceError` listing each
        failure is raised at the end.
    """
    case = ConformanceCase(make_model, **case_options)
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ConfigurationError(f"unknown conformance checks {unknown}; known: {list(CHECKS)}.")
    results: dict[str, str] = {}
    failures: list[str] = []
    for name in names:
        try:
            CHECKS[name](case)
        except Exception as err:  # collect every failure, then report them together
            results[name] = f"FAILED: {type(err).__name__}: {err}"
            failures.append(f"{name}: {type(err).__name__}: {err}")
        else:
            results[name] = "ok"
    if failures:
        raise ConformanceError("conformance failed:\n  " + "\n  ".join(failures))
    return results
