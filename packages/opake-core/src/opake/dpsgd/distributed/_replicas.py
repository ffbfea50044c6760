"""Which tensors every replica must hold identically, and the check that they do."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, overload

from opake.core.errors import InputTypeError, OperationError
from opake.dpsgd.distributed._comm import fingerprint
from opake.dpsgd.distributed._env import _world

if TYPE_CHECKING:
    import torch

__all__ = ["check_replicas_in_sync", "unwrap_ddp"]

T = TypeVar("T")


@overload
def unwrap_ddp(module: torch.nn.Module) -> torch.nn.Module: ...
@overload
def unwrap_ddp(module: T) -> T: ...


def unwrap_ddp(module: object) -> object:
    """The module inside a ``DistributedDataParallel`` wrapper (any other object unchanged).

    Build ``make_functional`` on the unwrapped module: DDP's ``forward`` may run collectives
    (buffer broadcasts) once per call, and under Poisson sampling ranks make different numbers
    of forward calls, which would deadlock. Opake reduces the clipped sums itself.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> unwrap_ddp(net) is net
        True
    """
    import torch

    while isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def _comm_device(group: Any) -> torch.device:
    """Where collective buffers live: the current CUDA device for nccl, else CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(row: torch.Tensor, *, group: Any, world_size: int) -> torch.Tensor:
    """All-gather one float64 row per rank: a ``[world_size, n]`` CPU tensor."""
    import torch
    import torch.distributed as dist

    device = _comm_device(group)
    local = row.to(device=device, dtype=torch.float64).contiguous()
    rows = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


def _structure_hash(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """48-bit hash of names, shapes and dtypes (exact in float64)."""
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return int.from_bytes(digest.digest()[:6], "big")


def _replica_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors every replica must hold identically: parameters (and buffers of a module)."""
    import torch

    if isinstance(params, torch.nn.Module):
        named: list[tuple[str, torch.Tensor]] = list(params.named_parameters())
        named += [(f"buffer:{n}", b) for n, b in params.named_buffers()]
        return named
    if isinstance(params, Mapping):
        return [(str(n), t) for n, t in params.items() if isinstance(t, torch.Tensor)]
    raise InputTypeError(
        f"params={type(params).__name__}: expected the nn.Module (or its DistributedDataParallel "
        "wrapper) or the name -> tensor dict from make_functional"
    )


def check_replicas_in_sync(
    params: Any, *, group: Any = None, what: str = "parameters"
) -> tuple[float, float]:
    """Raise :class:`OperationError` on every rank if the replicas' tensors differ.

    ``params`` is a module (parameters and buffers) or a ``name -> tensor`` dict. Compares a
    float64 fingerprint of every rank's tensors (one small all-gather); the check is exact, so
    any drift — different seeds, a rank that skipped a step, a non-deterministic update — is
    reported. Returns this rank's fingerprint. A single process always passes.

    Example:
        >>> import torch
        >>> from opake.dpsgd.distributed import check_replicas_in_sync
        >>> _ = check_replicas_in_sync(torch.nn.Linear(2, 1))  # one process: trivially in sync
    """
    import torch

    named = _replica_tensors(unwrap_ddp(params))
    local = fingerprint([t for _, t in named])
    rank, world_size = _world(group)
    if world_size == 1:
        return local
    rows = _gather_rows(
        torch.tensor(local, dtype=torch.float64), group=group, world_size=world_size
    )
    reference = rows[0]
    differing = [
        r
        for r in range(world_size)
        if not bool(torch.equal(rows[r], reference))
        and not (bool(torch.isnan(rows[r]).any()) and bool(torch.isnan(reference).any()))
    ]
    if differing:
        raise OperationError(
            f"the {what} differ between ranks: rank(s) {differing} do not match rank 0 (this is "
            f"rank {rank}). Data-parallel DP-SGD needs identical replicas: start every rank from "
            "the same weights (DistributedDPOptimizer broadcasts rank 0's), use the same noise "
            "seed, and call step() on every rank for every logical step"
        )
    return local
