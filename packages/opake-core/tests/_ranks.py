"""Start test workers as ``torchrun`` would: one process per rank with its launcher variables.

Loaded by the multi-process tests (``importlib``: the tests folder is not a package)::

    R = load_ranks()  # see each test file's header
    ranks = R.launch([sys.executable, str(WORKER), scenario, str(out)])
    R.require_success(ranks)
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: the variables a launcher sets for each rank (removed from the parent's environment first)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Rank:
    """One rank's exit status and output."""

    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(
    rank: int, world_size: int, port: int, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment with rank ``rank``'s launcher variables (one thread)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    env.update(extra or {})
    return env


def launch(
    command: Sequence[str],
    *,
    world_size: int = 2,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> list[Rank]:
    """Run ``command`` as ranks ``0 .. world_size - 1`` and wait (killing what is left after
    ``timeout`` seconds in all)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            list(command),
            env=rank_env(rank, world_size, port, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    ranks = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            ranks.append(Rank(proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ranks


def require_success(ranks: Sequence[Rank]) -> None:
    """Fail with the stderr of every rank that exited with an error."""
    failed = [(r, rank) for r, rank in enumerate(ranks) if rank.returncode != 0]
    assert not failed, "\n".join(
        f"--- rank {r} exited {rank.returncode}:\n{rank.stderr[-4000:]}" for r, rank in failed
    )
