"""Process-group set-up for distributed DP-SGD (implementation of :mod:`opake.dpsgd.distributed`).

:func:`init_distributed` reads the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), picks a backend (``nccl`` for CUDA, ``gloo``
otherwise) and initialises the default process group with a finite timeout, so a collective
waiting for a dead or stuck rank raises instead of hanging. Without a launcher (no
``WORLD_SIZE``, or ``WORLD_SIZE=1``) it returns a single-process context: the same training
script runs with and without ``torchrun``.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.randomness import Randomness

__all__ = ["DistributedContext", "current_context", "init_distributed"]

#: Default collective timeout (seconds): long enough for a slow checkpoint write, short enough
#: that a dead rank does not hold the others for torch's default of 10-30 minutes.
DEFAULT_TIMEOUT_SEC = 300.0
_BACKENDS = ("gloo", "nccl")


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as err:
        raise ConfigurationError(
            f"environment variable {name}={raw!r}: expected an integer (set by torchrun)"
        ) from err
    if value < 0:
        raise ConfigurationError(f"environment variable {name}={value}: expected an int ≥ 0")
    return value


def _timeout_seconds(timeout: object) -> float:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InputTypeError(
            f"timeout={timeout!r} ({type(timeout).__name__}): expected seconds (a float) or a "
            "datetime.timedelta"
        )
    if not math.isfinite(seconds) or seconds <= 0.0:
        raise ConfigurationError(
            f"timeout={timeout!r}: expected a finite number of seconds > 0 (the longest a "
            "collective may wait for the other ranks)"
        )
    return seconds


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands in a data-parallel run.

    Attributes:
        rank: global rank of this process (0 in a single-process run).
        world_size: number of processes (1 without a launcher).
        local_rank: rank on this node (selects the CUDA device).
        backend: ``"gloo"`` or ``"nccl"``; ``None`` in a single-process run (no process group).
        device: the device this rank computes on.
        timeout_sec: the process group's collective timeout (``None`` when unknown/not set here).
        group: the process group used for collectives (``None``: the default group).
        owns_group: whether :meth:`close` destroys the default process group (it was created by
            :func:`init_distributed`).

    Example:
        >>> from opake.dpsgd.distributed import init_distributed
        >>> ctx = init_distributed()  # no launcher: a single-process context
        >>> ctx.rank, ctx.world_size, ctx.is_main, ctx.is_distributed
        (0, 1, True, False)
        >>> ctx.sampler_kwargs()
        {'rank': 0, 'world_size': 1}
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    timeout_sec: float | None = None
    group: Any = None
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process takes part."""
        return self.world_size > 1

    def sampler_kwargs(self) -> dict[str, int]:
        """``rank``/``world_size`` for :class:`opake.dpsgd.sampling.PoissonSampler` (shards)."""
        return {"rank": self.rank, "world_size": self.world_size}

    def shared_randomness(self) -> Randomness:
        """A secure :class:`~opake.dpsgd.randomness.Randomness` whose key rank 0 drew and every
        rank received (see :func:`shared_randomness`)."""
        return shared_randomness(self.group if self.is_distributed else None)

    def barrier(self) -> None:
        """Wait for every rank (a no-op in a single-process run)."""
        if self.is_distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def close(self, *, synchronize: bool = False) -> None:
        """Destroy the process group if :func:`init_distributed` created it (idempotent).

        ``synchronize=True`` first waits for every rank (what leaving the ``with`` block
        normally does): rank 0 hosts the rendezvous store, and a rank still tearing down its
        group when rank 0 has already gone down can abort in the backend's threads
        (``terminate called without an active exception``).
        """
        if not self.owns_group:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if synchronize and self.is_distributed:
                dist.barrier(group=self.group)
            dist.destroy_process_group()

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # after an error the other ranks may be gone: no barrier (the timeout would only delay)
        self.close(synchronize=exc_type is None)


def _device_for(backend: str | None, local_rank: int, device: object) -> torch.device:
    import torch

    if device is not None:
        wrong = f"device={device!r}: expected a torch.device or a string like 'cpu' or 'cuda'"
        if not isinstance(device, torch.device | str | int):
            raise InputTypeError(wrong)
        try:
            resolved = torch.device(device)
        except (TypeError, RuntimeError) as err:
            raise InputTypeError(wrong) from err
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", local_rank)
        return resolved
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised process group.

    A launcher that says ``WORLD_SIZE > 1`` while no process group exists is an error: every
    rank would silently train on its own shard with its own noise.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise ConfigurationError(
            "a process group was given but torch.distributed is not initialised; call "
            "opake.dpsgd.distributed.init_distributed() (or init_process_group) first"
        )
    env_world = _env_int("WORLD_SIZE", 1) or 1
    if env_world > 1:
        raise ConfigurationError(
            f"WORLD_SIZE={env_world} in the environment (a launcher such as torchrun started "
            "several processes) but torch.distributed is not initialised: each rank would train "
            "alone on its shard. Call opake.dpsgd.distributed.init_distributed() first"
        )
    return 0, 1


def current_context(group: Any = None) -> DistributedContext:
    """Describe an already-initialised process group (or a single process when there is none).

    Use this when your own code called ``torch.distributed.init_process_group``.

    Example:
        >>> from opake.dpsgd.distributed import current_context
        >>> current_context().world_size
        1
    """
    import torch
    import torch.distributed as dist

    rank, world_size = _world(group)
    local_rank = _env_int("LOCAL_RANK", 0) or 0
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return DistributedContext(0, 1, local_rank, None, torch.device("cpu"))
    backend = str(dist.get_backend(group))
    device = _device_for(backend, local_rank, None)
    return DistributedContext(rank, world_size, local_rank, backend, device, group=group)


def init_distributed(
    backend: str | None = None,
    *,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_SEC,
    device: str | torch.device | None = None,
) -> DistributedContext:
    """Initialise ``torch.distributed`` from the launcher's environment, with a finite timeout.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); default ``nccl`` when CUDA is available
            and ``device`` is not a CPU device, ``gloo`` otherwise.
        timeout: how long (seconds or a ``timedelta``) a collective waits for the other ranks
            before raising — a dead or stuck rank makes the others fail after at most this
            long (use :func:`~opake.dpsgd.distributed.fail_fast` to fail sooner, with the cause).
        device: this rank's device; default ``cuda:LOCAL_RANK`` with nccl, else CPU. With a
            CUDA device, ``torch.cuda.set_device`` is called.

    Returns a :class:`DistributedContext`. Without a launcher (``WORLD_SIZE`` unset or 1) no
    process group is created and the context describes a single process. If the default
    process group already exists it is described, not re-created.

    Example:
        >>> from opake.dpsgd.distributed import init_distributed
        >>> with init_distributed(timeout=60) as ctx:
        ...     ctx.world_size, ctx.backend, str(ctx.device)
        (1, None, 'cpu')
    """
    import torch
    import torch.distributed as dist

    seconds = _timeout_seconds(timeout)
    if backend is not None and backend not in _BACKENDS:
        raise ConfigurationError(
            f"backend={backend!r}: expected one of {', '.join(_BACKENDS)} (gloo for CPU, nccl "
            "for CUDA) or None to choose from the device"
        )
    if not dist.is_available():
        raise OperationError(
            "torch.distributed is not available in this PyTorch build; install a build with "
            "distributed support to train on several processes"
        )
    if dist.is_initialized():
        return current_context()
    world_size = _env_int("WORLD_SIZE", 1) or 1
    rank = _env_int("RANK", 0) or 0
    local_rank = _env_int("LOCAL_RANK", 0) or 0
    if world_size == 1:
        return DistributedContext(
            0, 1, local_rank, None, _device_for(None, local_rank, device), timeout_sec=seconds
        )
    if rank >= world_size:
        raise ConfigurationError(
            f"RANK={rank} with WORLD_SIZE={world_size}: expected 0 ≤ RANK < WORLD_SIZE"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigurationError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with torchrun "
            "(or set MASTER_ADDR and MASTER_PORT to rank 0's address and a free port)"
        )
    if backend is None:
        wants_cpu = device is not None and torch.device(device).type == "cpu"
        backend = "nccl" if torch.cuda.is_available() and not wants_cpu else "gloo"
    resolved = _device_for(backend, local_rank, device)
    if backend == "nccl" and resolved.type != "cuda":
        raise ConfigurationError(
            f"backend='nccl' with device={resolved}: nccl reduces CUDA tensors only; use "
            "backend='gloo' on CPU"
        )
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=seconds),
    )
    return DistributedContext(
        rank,
        world_size,
        local_rank,
        backend,
        resolved,
        timeout_sec=seconds,
        owns_group=True,
    )


def shared_randomness(group: Any = None) -> Randomness:
    """One secure random source for every rank of a run: rank 0 draws a 256-bit key from the
    operating system and sends it to the others (over the process group, inside the cluster).

    Give it to every rank's sampler (``PoissonSampler(..., randomness=shared_randomness(),
    rank=r, world_size=W)``) so all ranks draw the same global batch from a key nobody stores.
    Without an initialised process group it is simply ``Randomness.secure()``.

    Example:
        >>> shared_randomness().is_secure
        True
    """
    from opake.dpsgd.randomness import Randomness

    rank, world_size = _world(group)
    if world_size == 1:
        return Randomness.secure()
    import torch.distributed as dist

    box: list[Any] = [Randomness.secure().export_key() if rank == 0 else None]
    dist.broadcast_object_list(box, src=_global_rank_zero(group), group=group)
    return Randomness.from_key(box[0])


def _global_rank_zero(group: Any) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_global_rank(group, 0))
