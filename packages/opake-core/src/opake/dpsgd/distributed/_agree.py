"""Agreement of the ranks on the configuration of a DistributedDPOptimizer.

Every rank describes its model structure, noise, sampler and divisor in one plain dict;
one all-gather collects them and :func:`_config_problems` lists every difference, so that a
misconfigured rank fails on every rank at construction, not silently mid-training.
"""

from __future__ import annotations

import math
from typing import Any

_AGREE_HINTS = {
    "structure": "the model (parameter names, shapes, dtypes)",
    "noise_sync": "noise_sync",
    "noise_seed": "the noise seed",
    "noise_key": "the noise key (randomness=)",
    "noise_multiplier": "noise_multiplier",
    "sampler": "the sampler (type, seed or key, configuration or position)",
}


def _local_config(
    options: dict[str, Any], mode: str, *, structure: Any, rank: int
) -> dict[str, Any]:
    """This rank's configuration (plain values), with a proposed shared key on rank 0."""
    noise = options.get("noise")
    sampler = options.get("sampler")
    randomness = options.get("randomness")
    # the default: a secure key drawn on rank 0 and shared (never stored), so every rank
    # draws the same noise without a broadcast of the noised sum
    share_key = (
        noise is None
        and options.get("seed") is None
        and randomness is None
        and not options.get("secure")
    )
    mine: dict[str, Any] = {
        "structure": structure,
        "noise_sync": mode,
        "noise_seed": options.get("seed") if noise is None else getattr(noise, "seed", None),
        "noise_key": None if randomness is None else randomness.fingerprint,
        "noise_multiplier": options.get(
            "noise_multiplier", getattr(noise, "noise_multiplier", None)
        ),
        "expected_batch_size": options.get("expected_batch_size"),
        "sample_rate": options.get("sample_rate"),
        "sampler": None,
        "shard": None,
        "proposed_key": _fresh_key() if share_key and rank == 0 else None,
    }
    if sampler is not None:
        state = sampler.state_dict() if callable(getattr(sampler, "state_dict", None)) else {}
        source = getattr(sampler, "randomness", None)
        mine["sampler"] = {
            "type": type(sampler).__name__,
            "seed": getattr(sampler, "seed", None),
            "key": getattr(source, "fingerprint", None),
            "config": state.get("config"),
            "position": getattr(sampler, "position", None),
        }
        mine["shard"] = (getattr(sampler, "rank", None), getattr(sampler, "world_size", None))
    return mine


def _config_problems(everyone: list[Any], world_size: int) -> list[str]:
    """Every difference between the ranks' configurations (empty: they agree)."""
    problems = []
    wrong_shard = [
        f"rank {r} has a sampler for shard {conf['shard']}"
        for r, conf in enumerate(everyone)
        if conf["shard"] is not None and conf["shard"] != (r, world_size)
    ]
    if wrong_shard:
        problems.append(
            f"{', '.join(wrong_shard)}: build each rank's sampler with rank=<its rank>, "
            f"world_size={world_size} (otherwise examples are counted on several ranks "
            "and the sensitivity is no longer the clipping bound)"
        )
    for key in (
        "structure",
        "noise_sync",
        "noise_seed",
        "noise_key",
        "noise_multiplier",
        "sampler",
    ):
        values = [conf[key] for conf in everyone]
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            problems.append(f"{_AGREE_HINTS[key]} differs between rank 0 and rank(s) {differing}")
    for key in ("expected_batch_size", "sample_rate"):
        values = [conf[key] for conf in everyone]
        if any(
            (v is None) != (values[0] is None)
            or (v is not None and not math.isclose(float(v), float(values[0]), rel_tol=1e-12))
            for v in values
        ):
            problems.append(f"{key} differs between ranks: {values}")
    return problems


def _fresh_key() -> bytes:
    from opake.dpsgd.randomness import Randomness

    return Randomness.secure().export_key()
