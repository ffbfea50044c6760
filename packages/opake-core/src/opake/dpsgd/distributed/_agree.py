"""Agreement of the ranks: on the configuration of a DistributedDPOptimizer, and on their
place in the sequence of level-2 collectives.

Every rank describes its model structure, noise, sampler and divisor in one plain dict;
one all-gather collects them and :func:`_config_problems` lists every difference, so that a
misconfigured rank fails on every rank at construction, not silently mid-training. Every step's
agreement (``DistributedDPOptimizer._agree_on_pending``) carries each rank's
:func:`sampler_position`, and :func:`drifted_samplers` refuses a step whose shards come from
different steps of the sampler (one rank skipped or repeated a batch).

Under per-layer sharded compute (level 2) every ``grad_fn`` call and every
``ShardedDPOptimizer.step`` starts with :func:`line_up`: one all-gather of a fixed-size row
(what the rank is doing, and the call's or the step's figures). The two share the row's size
and the collective, so when one rank steps while another runs one more ``grad_fn`` call, the
two all-gathers pair up and *both* ranks see it (:func:`out_of_step`) and raise, instead of
pairing the step's next collective with FSDP's all-gathers and hanging until the timeout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: what a rank is doing when it lines up: a level-2 ``grad_fn`` call, or the optimizer's step
CALL, STEP = 1, 2
#: the fields of a line-up row, in order (an absent field is 0)
LINEUP_FIELDS = ("kind", "batch", "index", "end_step", "microbatch", "scatter", "pending", "names")

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


def sampler_position(sampler: Any) -> int:
    """How many batches ``sampler`` has handed out (-1: no sampler, or one without a position):
    a rank's entry in every step's agreement (:func:`drifted_samplers`)."""
    position = getattr(sampler, "position", None)
    if isinstance(position, bool) or not isinstance(position, int):
        return -1
    return position


def drifted_samplers(positions: Sequence[int], steps: int) -> str | None:
    """What the ranks' sampler positions at a step say (``None``: they agree). Equal positions
    mean every rank's shard comes from the same global draw, a look-ahead alike on every rank
    (a prefetching ``DataLoader``) included; otherwise the ranks' shards are independent
    draws and an example in two of them would be clipped and summed twice. The same text on
    every rank."""
    if all(p == positions[0] for p in positions):
        return None
    listed = ", ".join(f"rank {r}: {p}" for r, p in enumerate(positions))
    return (
        f"the ranks' sampler positions differ (batches handed out — {listed} — for logical "
        f"step {steps + 1}): their shards come from different steps of the sampler, independent "
        "Poisson draws, so an example in two of them would be clipped and summed twice "
        "(sensitivity 2·C) in a step accounted as one at q. Every rank must call "
        "step()/accumulate() for every batch its sampler yields, empty ones included (an empty "
        "shard goes through grad_fn, which returns zeros), never skip or repeat one, and iterate "
        "the sampler alike (the same DataLoader settings); the step was dropped on every rank, "
        "nothing noised or accounted: restart every rank's loop from the same position "
        "(sampler.seek(<steps taken>))"
    )


def _fresh_key() -> bytes:
    from opake.dpsgd.randomness import Randomness

    return Randomness.secure().export_key()


def line_up(kind: int, group: Any, **fields: int) -> list[dict[str, int]]:
    """Every rank's row (``kind`` :data:`CALL` or :data:`STEP`, then ``fields`` named in
    :data:`LINEUP_FIELDS`), by rank: one all-gather of the same size on every rank, whatever
    it is doing."""
    import torch
    import torch.distributed as dist

    from opake.dpsgd.distributed._replicas import _gather_rows

    unknown = set(fields) - set(LINEUP_FIELDS[1:])
    if unknown:  # pragma: no cover - a programming error
        raise KeyError(f"line_up: unknown fields {sorted(unknown)}")
    values = [float(kind), *(float(fields.get(name, 0)) for name in LINEUP_FIELDS[1:])]
    row = torch.tensor(values, dtype=torch.float64)
    rows = _gather_rows(row, group=group, world_size=dist.get_world_size(group))
    return [dict(zip(LINEUP_FIELDS, map(int, r.tolist()), strict=True)) for r in rows]


def out_of_step(rows: Sequence[dict[str, int]]) -> str | None:
    """What :func:`line_up`'s ``rows`` say is out of step (``None``: nothing): some ranks
    stepping while others call ``grad_fn``, or stepping ranks whose pending sums are of
    different kinds (already reduce-scattered, or full-size). The same text on every rank."""
    steps = [r for r, row in enumerate(rows) if row["kind"] == STEP]
    calls = [r for r, row in enumerate(rows) if row["kind"] != STEP]
    if steps and calls:
        pending = ", ".join(f"rank {r}: {rows[r]['pending']}" for r in steps)
        return (
            f"the ranks are out of step: rank(s) {steps} called ShardedDPOptimizer.step() "
            f"(physical batches accumulated: {pending}) while rank(s) {calls} called the "
            "sharded grad_fn once more. Every rank must call grad_fn the same number of times "
            "per logical step (a rank whose Poisson shard is empty too: its batch is padded "
            "and adds zero) and then step(): split every rank's shard into the same number of "
            "physical batches, and drop this step on every rank with zero_grad()"
        )
    scattered = [r for r in steps if rows[r]["scatter"]]
    if scattered and len(scattered) != len(steps):
        full = [r for r in steps if not rows[r]["scatter"]]
        return (
            f"rank(s) {scattered} accumulated a grad_fn(..., reduce_scatter=True) result "
            f"(already reduce-scattered) and rank(s) {full} full-size sums: every rank must "
            "pass reduce_scatter alike and accumulate what its grad_fn returned"
        )
    return None


def raise_together(problem: Exception | None, *, group: Any, world_size: int, what: str) -> None:
    """Share each rank's verdict on ``what`` (one all-gather) and raise on every rank if any
    refused: ``problem`` itself on a rank that refused, a
    :class:`~opake.core.errors.ConfigurationError` naming the refusing ranks on the others —
    before any rank acts on it, so none goes on into collectives the others have left."""
    from opake.core.errors import ConfigurationError

    if world_size > 1:
        import torch

        from opake.dpsgd.distributed._replicas import _gather_rows

        verdict = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float64)
        rows = _gather_rows(verdict, group=group, world_size=world_size)
        refused = [rank for rank in range(world_size) if rows[rank, 0] != 0]
        if problem is None and refused:
            raise ConfigurationError(
                f"{what} was refused on rank(s) {refused} (their error says why): nothing "
                "was restored on any rank. Put the checkpoint where every rank reads the same "
                "file, and build every rank's objects with the same settings"
            )
    if problem is not None:
        raise problem
