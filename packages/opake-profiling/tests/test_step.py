"""step_perf: marks ordering, timing sanity, per-mark and per-step memory, misuse."""

from __future__ import annotations

import time
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch

from opake.profiling import (
    ConfigurationError,
    InputTypeError,
    OperationError,
    StepPerf,
    empty_cache,
    get_memory_stats,
    reset_peak_memory,
    step_perf,
)

MB = 1024**2 / 1024**3
# The memory tests allocate `fresh_block`s (conftest.py): mappings of their own, so the resident
# set grows and shrinks with them exactly. (A large torch tensor is not enough: glibc serves it
# from a free heap chunk, often still resident, whenever one is large enough.)
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="exact CPU peaks need /proc (Linux)"
)


def test_marks_are_ordered_and_timed():
    with step_perf("cpu", batch_size=16) as perf:
        time.sleep(0.02)
        perf.mark("forward")
        time.sleep(0.04)
        perf.mark("backward")
        time.sleep(0.01)
        perf.mark("forward")  # a repeated name is a second sub-step
    r = perf.result
    assert isinstance(r, StepPerf)
    assert [m.name for m in r.marks] == ["forward", "backward", "forward"]
    first, second, third = r.marks
    assert 0.02 <= first.time_sec < 0.02 + 0.05
    assert 0.04 <= second.time_sec < 0.04 + 0.05
    assert 0.01 <= third.time_sec < 0.01 + 0.05
    # elapsed is cumulative and never exceeds the step; the mark times add up
    assert first.elapsed_sec < second.elapsed_sec < third.elapsed_sec <= r.step_time_sec
    assert sum(m.time_sec for m in r.marks) <= third.elapsed_sec + 1e-9
    assert third.elapsed_sec - sum(m.time_sec for m in r.marks) < 0.005  # bookkeeping is cheap
    assert 0.07 <= r.step_time_sec < 0.07 + 0.1
    assert r.samples_per_second == pytest.approx(16 / r.step_time_sec)
    assert r.mark_times() == {
        "forward": pytest.approx(first.time_sec + third.time_sec),
        "backward": pytest.approx(second.time_sec),
    }
    with pytest.raises(FrozenInstanceError):
        r.step_time_sec = 0.0


@needs_proc
def test_step_and_mark_peaks_are_scoped(fresh_block):
    fresh_block(96).free()  # 96 MiB alive before the step: not the step's peak
    empty_cache("cpu")
    base = get_memory_stats("cpu").allocated_gb
    with step_perf("cpu") as perf:
        small = fresh_block(40)
        perf.mark("small")
        fresh_block(80).free()
        perf.mark("large")
        small.free()
        perf.mark("idle")
    r = perf.result
    small_m, large_m, idle_m = r.marks
    assert r.memory_peak_exact
    assert r.memory_process_level
    assert small_m.memory_peak_gb - base == pytest.approx(40 * MB, abs=6 * MB)
    assert large_m.memory_peak_gb - base == pytest.approx(120 * MB, abs=8 * MB)
    assert idle_m.memory_peak_gb - base == pytest.approx(40 * MB, abs=6 * MB)
    assert r.memory_peak_gb == pytest.approx(large_m.memory_peak_gb, abs=1 * MB)
    assert small_m.memory_allocated_gb - base == pytest.approx(40 * MB, abs=6 * MB)
    # at exit `small` is unmapped: the resident set is back at the base
    assert r.memory_allocated_gb <= small_m.memory_allocated_gb - 34 * MB
    assert r.memory_allocated_gb - base == pytest.approx(0, abs=6 * MB)
    assert r.memory_reserved_gb == pytest.approx(r.memory_allocated_gb, abs=1 * MB)
    d = r.to_dict(prefix="step/")
    assert d["step/marks/large_peak_gb"] == large_m.memory_peak_gb
    assert d["step/memory_peak_gb"] == r.memory_peak_gb
    assert "step/samples_per_second" not in d  # no batch size given


@needs_proc
def test_nested_windows_and_user_resets_keep_the_outer_peak(fresh_block):
    empty_cache("cpu")
    base = get_memory_stats("cpu").allocated_gb
    with step_perf("cpu") as outer:
        fresh_block(64).free()
        reset_peak_memory("cpu")  # a user reset inside the step
        with step_perf("cpu") as inner:
            fresh_block(40).free()
        outer.mark("after-inner")
    assert inner.result.memory_peak_gb - base == pytest.approx(40 * MB, abs=6 * MB)
    assert outer.result.memory_peak_gb - base == pytest.approx(64 * MB, abs=8 * MB)
    assert outer.result.marks[0].memory_peak_gb - base == pytest.approx(64 * MB, abs=8 * MB)


def test_track_memory_false_measures_time_only():
    with step_perf("cpu", batch_size=2, track_memory=False) as perf:
        perf.mark("a")
    r = perf.result
    assert r.memory_peak_gb is None
    assert r.memory_allocated_gb is None
    assert r.marks[0].memory_peak_gb is None
    assert not r.memory_peak_exact
    assert set(r.to_dict()) == {"step_time_sec", "batch_size", "samples_per_second", "marks/a_sec"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the missing-CUDA path")
def test_missing_backend_times_without_memory():
    with step_perf("cuda", batch_size=4) as perf:
        perf.mark("x")
    r = perf.result
    assert r.device == "cuda"
    assert r.step_time_sec > 0
    assert r.memory_peak_gb is None
    assert r.marks[0].memory_peak_gb is None


def test_misuse_raises_typed_errors():
    ctx = step_perf("cpu")
    with pytest.raises(OperationError, match="outside"):
        ctx.mark("early")
    with ctx as perf:
        with pytest.raises(OperationError, match="inside the block"):
            _ = perf.result
        with pytest.raises(InputTypeError):
            perf.mark("")
        with pytest.raises(InputTypeError):
            perf.mark(3)  # type: ignore[arg-type]
    with pytest.raises(OperationError, match="already used"), ctx:
        pass
    with pytest.raises(OperationError, match="outside"):
        ctx.mark("late")

    with pytest.raises(ZeroDivisionError), step_perf("cpu") as failed:
        _ = 1 / 0
    with pytest.raises(OperationError, match="raised"):
        _ = failed.result

    with pytest.raises(ConfigurationError, match="batch_size=-1"):
        step_perf("cpu", batch_size=-1)
    with pytest.raises(InputTypeError, match="batch_size"):
        step_perf("cpu", batch_size="8")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="batch_size"):
        step_perf("cpu", batch_size=True)
    with pytest.raises(InputTypeError, match="track_memory"):
        step_perf("cpu", track_memory=1)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="device"):
        step_perf("gpu")
    with pytest.raises(TypeError):
        step_perf("cpu", batchsize=8)  # type: ignore[call-arg]
