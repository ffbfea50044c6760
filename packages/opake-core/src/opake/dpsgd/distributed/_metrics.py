"""Per-rank figures (step time, memory, …) gathered and aggregated across ranks.

Implementation of :func:`opake.dpsgd.distributed.gather_metrics`. It takes a flat
``name -> number`` dict or anything with ``to_dict()`` returning one — ``opake.profiling``'s
``StepPerf`` (one step) and ``PerfState`` (a run) do — so opake-core does not depend on
opake-profiling.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opake.core.errors import InputTypeError
from opake.dpsgd.distributed._env import _world

__all__ = ["RankMetrics", "gather_metrics"]

_STATS = ("min", "max", "mean", "sum")


@dataclass(frozen=True)
class RankMetrics:
    """Every rank's figures and their aggregates (identical on every rank).

    Which aggregate means what: for a synchronous data-parallel step the *slowest* rank sets
    the pace, so ``step_time_sec/max`` is the step time and ``max / mean`` the imbalance;
    throughputs add up (``samples_per_second/sum``); memory is per rank
    (``memory_peak_gb/max`` is what each device must hold, ``/sum`` the whole job's). On CPU,
    ``opake.profiling`` memory figures are process RSS.

    Attributes:
        per_rank: one ``name -> value`` dict per rank, in rank order.

    Example:
        >>> m = RankMetrics(({"step_time_sec": 1.0}, {"step_time_sec": 3.0}))
        >>> m.aggregate()["step_time_sec"]
        {'min': 1.0, 'max': 3.0, 'mean': 2.0, 'sum': 4.0}
        >>> m.imbalance("step_time_sec")
        1.5
    """

    per_rank: tuple[dict[str, float], ...]

    @property
    def world_size(self) -> int:
        """Number of ranks reported."""
        return len(self.per_rank)

    def aggregate(self) -> dict[str, dict[str, float]]:
        """``name -> {min, max, mean, sum}`` over the ranks that report ``name``."""
        names: dict[str, None] = {}
        for figures in self.per_rank:
            names.update(dict.fromkeys(figures))
        out: dict[str, dict[str, float]] = {}
        for name in names:
            values = [figures[name] for figures in self.per_rank if name in figures]
            out[name] = {
                "min": min(values),
                "max": max(values),
                "mean": math.fsum(values) / len(values),
                "sum": math.fsum(values),
            }
        return out

    def imbalance(self, name: str = "step_time_sec") -> float:
        """``max / mean`` of ``name`` over the ranks (1.0 = perfectly balanced)."""
        stats = self.aggregate().get(name)
        if stats is None:
            raise InputTypeError(
                f"imbalance({name!r}): no rank reported {name!r}; reported: "
                f"{sorted(self.aggregate())}"
            )
        return stats["max"] / stats["mean"] if stats["mean"] else 1.0

    def to_dict(self, prefix: str = "", *, per_rank: bool = True) -> dict[str, float]:
        """Flat dict for a logger: ``<prefix><name>/<stat>`` and ``<prefix>rank<r>/<name>``."""
        out: dict[str, float] = {}
        for name, stats in self.aggregate().items():
            for stat in _STATS:
                out[f"{prefix}{name}/{stat}"] = stats[stat]
        if per_rank:
            for r, figures in enumerate(self.per_rank):
                for name, value in figures.items():
                    out[f"{prefix}rank{r}/{name}"] = value
        return out


def _as_figures(metrics: Any) -> dict[str, float]:
    source = metrics.to_dict() if callable(getattr(metrics, "to_dict", None)) else metrics
    if not isinstance(source, Mapping):
        raise InputTypeError(
            f"metrics={type(metrics).__name__}: expected a name -> number dict or an object with "
            "to_dict() (opake.profiling's StepPerf or PerfState)"
        )
    figures: dict[str, float] = {}
    for name, value in source.items():
        if not isinstance(name, str):
            raise InputTypeError(f"metrics key {name!r}: expected a str")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputTypeError(
                f"metrics[{name!r}]={value!r} ({type(value).__name__}): expected a number"
            )
        figures[name] = float(value)
    return figures


def gather_metrics(metrics: Any, *, group: Any = None) -> RankMetrics:
    """All-gather every rank's figures; every rank gets the same :class:`RankMetrics`.

    ``metrics`` is a ``name -> number`` dict or an object with ``to_dict()`` (e.g. the
    ``StepPerf`` of ``opake.profiling.step_perf`` or a ``PerfState``). Every rank must call it
    (it is a collective); ranks may report different names. In one process it wraps the
    figures without communicating.

    Example:
        >>> from opake.dpsgd.distributed import gather_metrics
        >>> figures = gather_metrics({"step_time_sec": 0.5, "memory_peak_gb": 1.25})
        >>> flat = figures.to_dict(per_rank=False)
        >>> flat["step_time_sec/max"], flat["memory_peak_gb/sum"], figures.world_size
        (0.5, 1.25, 1)
    """
    figures = _as_figures(metrics)
    _, world_size = _world(group)
    if world_size == 1:
        return RankMetrics((figures,))
    import torch.distributed as dist

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, figures, group=group)
    return RankMetrics(tuple(dict(f) for f in everyone))
