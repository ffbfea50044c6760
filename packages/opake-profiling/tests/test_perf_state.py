"""PerfState: immutable accumulation, averages with and without the warm-up step."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from opake.profiling import (
    ConfigurationError,
    InputTypeError,
    MarkPerf,
    PerfState,
    StepPerf,
    step_perf,
)


def _step(t: float, batch: int, peak: float | None, marks: dict[str, float] | None = None):
    ms = tuple(
        MarkPerf(name=k, time_sec=v, elapsed_sec=v, memory_peak_gb=None, memory_allocated_gb=None)
        for k, v in (marks or {}).items()
    )
    return StepPerf(device="cpu", batch_size=batch, step_time_sec=t, memory_peak_gb=peak, marks=ms)


def test_arithmetic():
    empty = PerfState(device="cpu")
    assert empty.steps == 0
    assert empty.average_step_time_sec is None
    assert empty.average_samples_per_second is None
    assert empty.average_step_time_sec_excl_first is None
    assert empty.to_dict(prefix="train/") == {
        "train/steps": 0.0,
        "train/samples": 0.0,
        "train/time_sec": 0.0,
    }

    s1 = empty.add(_step(2.0, 8, 1.5, {"clip": 0.5}))
    s2 = s1.add(_step(1.0, 8, None, {"clip": 0.25, "noise": 0.125}))
    s3 = s2.add(_step(0.5, 4, 3.0, {"clip": 0.25}))

    # immutability: every add returned a new state and left the old ones untouched
    assert (empty.steps, s1.steps, s2.steps, s3.steps) == (0, 1, 2, 3)
    assert s1.total_time_sec == 2.0
    assert s1.max_memory_peak_gb == 1.5
    with pytest.raises(FrozenInstanceError):
        s3.steps = 10

    assert s1.average_step_time_sec_excl_first is None  # one step: nothing after warm-up
    assert s3.total_time_sec == 3.5
    assert s3.total_samples == 20
    assert s3.average_step_time_sec == pytest.approx(3.5 / 3)
    assert s3.average_samples_per_second == pytest.approx(20 / 3.5)
    assert s3.average_step_time_sec_excl_first == pytest.approx(1.5 / 2)
    assert s3.average_samples_per_second_excl_first == pytest.approx(12 / 1.5)
    assert s3.max_memory_peak_gb == 3.0  # None figures are skipped, not treated as 0
    assert s2.max_memory_peak_gb == 1.5
    assert s3.mark_totals_sec == {"clip": 1.0, "noise": 0.125}
    assert s3.last.step_time_sec == 0.5

    d = s3.to_dict(prefix="train/")
    assert d == pytest.approx(
        {
            "train/steps": 3.0,
            "train/samples": 20.0,
            "train/time_sec": 3.5,
            "train/step_time_sec": 3.5 / 3,
            "train/samples_per_second": 20 / 3.5,
            "train/step_time_sec_excl_first": 0.75,
            "train/samples_per_second_excl_first": 8.0,
            "train/memory_peak_gb_max": 3.0,
            "train/marks/clip_sec": 1.0 / 3,
            "train/marks/noise_sec": 0.125 / 3,
        }
    )
    assert set(s3.to_dict()) == {k.removeprefix("train/") for k in d}


def test_with_real_steps():
    state = PerfState(device="cpu")
    for _ in range(3):
        with step_perf("cpu", batch_size=5) as perf:
            perf.mark("work")
        state = state.add(perf.result)
    assert state.steps == 3
    assert state.total_samples == 15
    assert state.max_memory_peak_gb > 0
    assert state.total_time_sec == pytest.approx(
        sum(s for s in (state.first_step_time_sec,)) + 2 * state.average_step_time_sec_excl_first
    )


def test_bad_input():
    state = PerfState(device="cpu")
    with pytest.raises(InputTypeError, match="StepPerf"):
        state.add({"step_time_sec": 1.0})  # type: ignore[arg-type]
    cuda_step = StepPerf(device="cuda:0", batch_size=1, step_time_sec=1.0)
    with pytest.raises(ConfigurationError, match="one PerfState per device"):
        state.add(cuda_step)
    with pytest.raises(InputTypeError):
        PerfState(device="nonsense")
    with pytest.raises(TypeError):
        PerfState("cpu")  # type: ignore[misc]  # device is keyword-only
