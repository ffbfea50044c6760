"""Data-parallel DP-SGD on ``torch.distributed`` (``torchrun``; gloo on CPU, nccl on CUDA).

One logical step across ``W`` ranks::

    each rank: its shard of the global Poisson batch ──► clipped_grad (fp32 sums)
        ──► all-reduce SUM (fp32) ──► + N(0, σ²C²) once, identical on every rank
        ──► / global expected batch size q·N ──► identical update ──► accountant (global q)

- :func:`init_distributed` — process group from ``torchrun``'s environment, with a finite
  timeout; a single-process context without a launcher;
- :class:`DistributedDPOptimizer` — :class:`~opake.dpsgd.optimizer.DPOptimizer` that reduces
  the clipped sums of every rank before the noise; :func:`unwrap_ddp` for DDP-wrapped modules;
- :func:`fail_fast` — one rank's exception stops every rank quickly, naming its cause;
- :func:`save_checkpoint_distributed` / :func:`load_checkpoint_distributed` — rank 0 writes
  atomically after every rank agreed; every rank restores;
- :func:`gather_metrics` — per-rank figures (e.g. ``opake.profiling.step_perf``) gathered and
  aggregated; :func:`check_replicas_in_sync` — verify identical parameters;
- :class:`ShardedDPOptimizer` with :func:`compute_template` and :func:`gather_full_params` —
  FSDP2 (``fully_shard``) parameters and optimizer state sharded at rest, gathered for the
  per-example step (see ``docs/design/fsdp2.md``, level 1);
- :func:`sharded_clipped_grad` — level 2: per-layer sharded compute with the book-keeping
  engine (FSDP gathers one unit at a time; the clipped sums feed ``ShardedDPOptimizer``);
  :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint` for its sharded state.

Sampling: build ``PoissonSampler(N, q, randomness=ctx.shared_randomness(),
**ctx.sampler_kwargs())`` on every rank (a secure key drawn on rank 0 and shared; ``seed=`` for
a reproducible, non-private run); each example is included with probability q over the whole
dataset and each rank keeps its share of the global batch. See ``docs/guide/distributed.md``.

Example:
    >>> from opake.dpsgd.distributed import init_distributed
    >>> ctx = init_distributed()  # without torchrun: one process, no collectives
    >>> ctx.world_size
    1
"""

from __future__ import annotations

from opake.dpsgd.distributed._checkpoint import (
    load_checkpoint_distributed,
    save_checkpoint_distributed,
)
from opake.dpsgd.distributed._env import (
    DEFAULT_TIMEOUT_SEC,
    DistributedContext,
    current_context,
    init_distributed,
    shared_randomness,
)
from opake.dpsgd.distributed._failure import ABORT_EXIT_CODE, FailFast, fail_fast
from opake.dpsgd.distributed._fsdp import ShardedDPOptimizer, compute_template, gather_full_params
from opake.dpsgd.distributed._metrics import RankMetrics, gather_metrics
from opake.dpsgd.distributed._optim import DistributedDPOptimizer
from opake.dpsgd.distributed._replicas import check_replicas_in_sync, unwrap_ddp
from opake.dpsgd.distributed.sharded import (
    ShardedClippedGradFn,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    sharded_clipped_grad,
)

__all__ = [
    "ABORT_EXIT_CODE",
    "DEFAULT_TIMEOUT_SEC",
    "DistributedContext",
    "DistributedDPOptimizer",
    "FailFast",
    "RankMetrics",
    "ShardedClippedGradFn",
    "ShardedDPOptimizer",
    "check_replicas_in_sync",
    "compute_template",
    "current_context",
    "fail_fast",
    "gather_full_params",
    "gather_metrics",
    "init_distributed",
    "load_checkpoint_distributed",
    "load_sharded_checkpoint",
    "save_checkpoint_distributed",
    "save_sharded_checkpoint",
    "sharded_clipped_grad",
    "shared_randomness",
    "unwrap_ddp",
]
