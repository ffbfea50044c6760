"""Keep the profiling modules' process-wide state (peak modes, sampled peaks) per test; give
memory tests allocations whose pages are fresh and their own."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator

import pytest
import torch

from opake.profiling import _cpu, _devices, _memory

MIB = 1024**2


@pytest.fixture(autouse=True)
def _isolate_memory_state():
    mode = dict(_cpu._CPU_PEAK_MODE)
    sampled = dict(_devices._SAMPLED_PEAK)
    yield
    _cpu._CPU_PEAK_MODE.clear()
    _cpu._CPU_PEAK_MODE.update(mode)
    _devices._SAMPLED_PEAK.clear()
    _devices._SAMPLED_PEAK.update(sampled)
    assert not any(_memory._OPEN_WINDOWS.values()), "a step_perf window was left open"


class FreshBlock:
    """``mib`` MiB in an anonymous mapping of its own, every page touched (a float32 tensor).

    ``torch.ones(64 MiB)`` is not enough for an exact RSS test inside a long test session: glibc
    serves a request from a free heap chunk that is large enough before it considers a mapping
    of its own (the mmap threshold only applies when the heap cannot serve it), and a chunk that
    earlier tests freed is often still resident. The RSS then does not grow with the tensor, nor
    shrink when it is freed. A mapping of its own grows the RSS by exactly its pages on first
    touch and gives them back on :meth:`free`.
    """

    def __init__(self, mib: int) -> None:
        self._map: mmap.mmap | None = mmap.mmap(-1, mib * MIB)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.float32)
        self.tensor.fill_(1.0)  # first touch: every page becomes resident

    def free(self) -> None:
        """Drop the tensor and unmap the pages (the RSS falls by the block's size)."""
        self.tensor = None
        if self._map is not None:
            self._map.close()
            self._map = None


@pytest.fixture
def fresh_block() -> Iterator[Callable[[int], FreshBlock]]:
    """A factory of :class:`FreshBlock` s; blocks a test did not free are freed after it."""
    blocks: list[FreshBlock] = []

    def make(mib: int) -> FreshBlock:
        blocks.append(FreshBlock(mib))
        return blocks[-1]

    yield make
    for block in blocks:
        block.free()
