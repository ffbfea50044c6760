"""Keep the profiling modules' process-wide state (peak modes, sampled peaks) per test."""

from __future__ import annotations

import pytest

from opake.profiling import _memory


@pytest.fixture(autouse=True)
def _isolate_memory_state():
    mode = dict(_memory._CPU_PEAK_MODE)
    sampled = dict(_memory._SAMPLED_PEAK)
    yield
    _memory._CPU_PEAK_MODE.clear()
    _memory._CPU_PEAK_MODE.update(mode)
    _memory._SAMPLED_PEAK.clear()
    _memory._SAMPLED_PEAK.update(sampled)
    assert not any(_memory._OPEN_WINDOWS.values()), "a step_perf window was left open"
