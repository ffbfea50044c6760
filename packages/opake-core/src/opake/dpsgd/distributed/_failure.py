"""Fail fast across ranks: one rank's exception stops the others, with its cause.

Implementation of :func:`opake.dpsgd.distributed.fail_fast`. Pattern (a watchdog with an
abort, over the rendezvous key-value store every process group already has):

- the rank that raises writes ``"rank R (host, pid N): Type: message"`` under a key of the
  store (the first failure wins), waits briefly until the other ranks have seen it, and
  re-raises;
- every rank runs a watchdog thread polling that key. When another rank's failure appears it
  prints it to stderr; the main thread — blocked in a collective that will now fail (gloo
  raises when the peer's connection closes; every backend raises at the process group's
  timeout) — leaves the guarded block with an :class:`~opake.core.errors.OperationError`
  naming the failed rank and its error. If it is still inside the block ``grace_sec`` later
  (a backend that only notices at the timeout, or a rank stuck outside any collective), the
  watchdog ends the process with ``os._exit(exit_code)``;
- a collective that fails with no failure reported (a rank killed by the OS, or stuck past
  the timeout) is reported as such, and recorded so the stuck rank is aborted too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.distributed._env import _world

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = ["FailFast", "fail_fast"]

_PREFIX = "opake/fail_fast"
#: Exit status of a process ended by the watchdog (``EX_SOFTWARE`` in ``sysexits.h``).
ABORT_EXIT_CODE = 70
_COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
    "socket",
)
_generation = 0
_generation_lock = threading.Lock()


def _is_collective_failure(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover - torch without distributed
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _COLLECTIVE_MARKERS)


def _default_store() -> Store:
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - very old or very new torch
        raise ConfigurationError(
            "fail_fast() could not find the process group's store; pass store= (a "
            "torch.distributed.Store shared by all ranks)"
        )
    store: Store = getter()
    return store


class FailFast:
    """Context manager returned by :func:`fail_fast` (see there).

    Attributes:
        rank, world_size: this process's place in the group.
        peer_failure: the failure another rank reported (``None`` while none has).
    """

    def __init__(
        self,
        *,
        group: Any = None,
        store: Any = None,
        grace_sec: float = 10.0,
        poll_sec: float = 0.1,
        exit_code: int = ABORT_EXIT_CODE,
    ) -> None:
        for name, value in (("grace_sec", grace_sec), ("poll_sec", poll_sec)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputTypeError(f"{name}={value!r}: expected seconds (a float)")
            if not value > 0:
                raise ConfigurationError(f"{name}={value!r}: expected a number of seconds > 0")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 < exit_code < 256:
            raise ConfigurationError(f"exit_code={exit_code!r}: expected an int in 1..255")
        self.rank, self.world_size = _world(group)
        self._group = group
        self._store_arg = store
        self._grace = float(grace_sec)
        self._poll = float(poll_sec)
        self._exit_code = exit_code
        self._store: Any = None
        self._key = ""
        self._ack = ""
        self._inside = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peer_failure: str | None = None

    # -- store ---------------------------------------------------------------------------

    def _open(self) -> None:
        import torch.distributed as dist

        global _generation
        with _generation_lock:
            _generation += 1
            generation = _generation
        base = self._store_arg if self._store_arg is not None else _default_store()
        # every rank enters its guards in the same order, so generation numbers line up
        prefix = f"{_PREFIX}/{generation}"
        # distributed_c10d: torch.distributed re-exports PrefixStore without declaring it
        self._store = dist.distributed_c10d.PrefixStore(prefix, base)
        self._key = "failed"
        self._ack = "acks"

    def _record(self) -> str | None:
        try:
            if self._store.check([self._key]):
                return bytes(self._store.get(self._key)).decode("utf-8", "replace")
        except Exception:  # the store's host is gone: nothing more to learn from it
            return None
        return None

    def _publish(self, message: str) -> str:
        """Write ``message`` unless another rank was first; return the recorded failure."""
        try:
            recorded = self._store.compare_set(self._key, "", message)
            return bytes(recorded).decode("utf-8", "replace")
        except Exception:
            return message

    def _wait_for_acks(self) -> None:
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline:
            try:
                if self._store.add(self._ack, 0) >= self.world_size - 1:
                    return
            except Exception:
                return
            time.sleep(self._poll)

    # -- watchdog ------------------------------------------------------------------------

    def _watch(self) -> None:
        mine = f"rank {self.rank} "
        while not self._stop.wait(self._poll):
            record = self._record()
            if record is None or record.startswith(mine):
                continue
            self.peer_failure = record
            with contextlib.suppress(Exception):
                self._store.add(self._ack, 1)
            _say(f"opake: {record}; rank {self.rank} is stopping (fail_fast)")
            if self._stop.wait(self._grace):
                return
            _say(
                f"opake: rank {self.rank} is still running {self._grace:g} s after that "
                f"failure (blocked in a collective or stuck): aborting the process "
                f"(exit {self._exit_code})"
            )
            os._exit(self._exit_code)

    # -- context manager -----------------------------------------------------------------

    def __enter__(self) -> FailFast:
        if self.world_size == 1:
            return self
        self._open()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, name=f"opake-fail-fast-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if self.world_size == 1 or self._thread is None:
            return False
        try:
            if isinstance(exc, GeneratorExit):
                return False
            peer = self.peer_failure or self._record()
            if exc is None:
                if peer is not None and not peer.startswith(f"rank {self.rank} "):
                    raise OperationError(
                        f"{peer} — rank {self.rank} finished its block, but the run failed"
                    )
                return False
            if peer is not None and not peer.startswith(f"rank {self.rank} "):
                raise OperationError(
                    f"{peer} — rank {self.rank} stopped because of it "
                    f"({type(exc).__name__}: {_short(exc)})"
                ) from exc
            if _is_collective_failure(exc):
                # nobody reported an error: a rank died without Python (killed, OOM) or hung
                message = (
                    f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}): a collective "
                    f"failed and no rank had reported an error: {type(exc).__name__}: "
                    f"{_short(exc)}. Another rank was killed, crashed outside fail_fast, or is "
                    "stuck past the process group timeout"
                )
                self._publish(message)
                self._wait_for_acks()
                raise OperationError(message) from exc
            recorded = self._publish(
                f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}) failed: "
                f"{type(exc).__name__}: {_short(exc)}"
            )
            if recorded.startswith(f"rank {self.rank} "):
                self._wait_for_acks()
            return False
        finally:
            self._stop.set()
            self._thread.join(timeout=self._poll * 10 + 1.0)
            self._thread = None


def _short(exc: BaseException, limit: int = 500) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _say(message: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def fail_fast(
    *,
    group: Any = None,
    store: Any = None,
    grace_sec: float = 10.0,
    poll_sec: float = 0.1,
    exit_code: int = ABORT_EXIT_CODE,
) -> FailFast:
    """Guard a training loop so that one rank's exception stops every rank quickly and clearly.

    Wrap the work of every rank (all ranks must enter and leave their guards in the same
    order)::

        with init_distributed(timeout=120) as ctx, fail_fast():
            train(...)

    If rank R raises, R publishes ``"rank R (host, pid) failed: Type: message"`` in the
    process group's store and re-raises its own exception; every other rank leaves its block
    with an :class:`~opake.core.errors.OperationError` carrying that text (as soon as its
    pending collective fails: at once with gloo, whose connections close when R exits), or is
    ended with ``os._exit(exit_code)`` after ``grace_sec`` if it cannot leave (a backend that
    waits for the timeout, a rank stuck outside collectives). A collective that times out with
    no reported failure raises :class:`~opake.core.errors.OperationError` saying so. The
    process group's timeout (``init_distributed(timeout=)``) bounds the wait when a rank dies
    without Python noticing (killed, out of memory).

    Args:
        group: the process group (default: the default group).
        store: a ``torch.distributed.Store`` shared by all ranks (default: the default process
            group's rendezvous store).
        grace_sec: how long a rank may stay inside the block after another rank failed, before
            it is aborted; also how long the failing rank waits for the others to see the
            failure before it re-raises.
        poll_sec: the watchdog's polling interval.
        exit_code: exit status of a process the watchdog aborts.

    In a single process the guard does nothing.

    Example:
        >>> from opake.dpsgd.distributed import fail_fast
        >>> with fail_fast():  # one process: a no-op
        ...     pass
    """
    return FailFast(
        group=group, store=store, grace_sec=grace_sec, poll_sec=poll_sec, exit_code=exit_code
    )
