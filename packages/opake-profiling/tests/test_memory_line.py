"""The memory-aware microbatch estimate: the line through two probe steps, the largest likely
Poisson batch, the choice from the line, and the memory a process may grow to."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from opake.profiling import (
    PROBE_EXAMPLES,
    MemoryLine,
    NoMicrobatchFitsError,
    _memory_line,
    available_memory_gb,
    choose_microbatch,
    get_memory_stats,
    largest_poisson_batch,
    measure_memory_line,
)
from opake.profiling import _memory as memory

CPU = torch.device("cpu")


def test_the_line_and_its_json_form():
    line = MemoryLine(base_gb=1.0, per_example_gb=0.25, probes=((1, 1.25), (16, 5.0)))
    assert line.peak_gb(8) == 3.0
    assert line.to_dict() == {
        "base_gb": 1.0,
        "per_example_gb": 0.25,
        "probes": [[1, 1.25], [16, 5.0]],
    }
    unknown = MemoryLine(base_gb=2.0, per_example_gb=math.inf)
    assert unknown.probes == ()
    assert unknown.to_dict()["per_example_gb"] is None  # JSON has no infinity
    assert math.isinf(unknown.peak_gb(1))


@pytest.mark.parametrize(
    ("expected", "rate", "cap", "largest"),
    [
        (16, 0.1, 1000, 35),
        (128, 0.1, 10_000, 182),
        (32, 32 / 85, 85, 55),
        (16, 0.1, 20, 20),
        (0, 0.0, 10, 1),
    ],
)
def test_the_largest_poisson_batch_is_five_sigmas_above_the_expected(expected, rate, cap, largest):
    assert largest_poisson_batch(expected, rate, cap) == largest


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(100.0, None), (6.0, None), (3.0, 16), (2.0, 8), (1.5, 4), (1.1, 1), (0.5, 1)],
)
def test_choice_from_the_line(limit, expected):
    line = MemoryLine(base_gb=1.0, per_example_gb=0.125, probes=((1, 1.125), (4, 1.5)))
    assert choose_microbatch(line, limit_gb=limit, largest_batch=40, expected_batch=16) == expected


def test_a_flat_line_over_the_limit_chooses_a_power_of_two_of_the_expected_batch():
    line = MemoryLine(base_gb=5.0, per_example_gb=0.0)
    assert choose_microbatch(line, limit_gb=4.0, largest_batch=40, expected_batch=12) == 8


def test_an_unknown_per_example_cost_chooses_one_example():
    line = MemoryLine(base_gb=1.0, per_example_gb=math.inf, probes=((1, 1.0),))
    assert choose_microbatch(line, limit_gb=100.0, largest_batch=40, expected_batch=16) == 1


def test_available_memory_is_what_the_process_holds_plus_what_is_free(monkeypatch):
    real = get_memory_stats("cpu")
    assert real.free_gb is not None
    assert available_memory_gb("cpu") == pytest.approx(
        (real.reserved_gb or 0.0) + real.free_gb, rel=0.05, abs=0.05
    )

    def stats(reserved, allocated, free):
        fake = dataclasses.replace(real, reserved_gb=reserved, allocated_gb=allocated, free_gb=free)
        monkeypatch.setattr(memory, "get_memory_stats", lambda device: fake)

    stats(3.0, 2.0, 10.0)  # what the allocator reserved counts, not only live tensors
    assert available_memory_gb(CPU) == 13.0
    stats(None, 2.0, 10.0)
    assert available_memory_gb(CPU) == 12.0
    stats(3.0, 2.0, None)  # no free figure: nothing to plan with
    assert available_memory_gb(CPU) is None


def _embedding_step(seen=None):
    """``m -> step``: each chunk of ``m`` rows gathers its own copy of a 256-wide embedding."""
    table = torch.randn(1000, 256)

    def make(m):
        def step(ids):
            if seen is not None:
                seen.append((m, tuple(ids.shape)))
            return [table[chunk].sum() for chunk in ids.split(m)]

        return step

    return make


def test_the_line_is_fitted_through_two_tuner_measurements():
    seen: list[tuple[int, tuple[int, ...]]] = []
    line = measure_memory_line(_embedding_step(seen), (), length=64, vocab=1000, device=CPU)
    assert [k for k, _ in line.probes] == [1, PROBE_EXAMPLES] == [1, 16]
    assert line.per_example_gb >= 0
    assert line.base_gb > 0
    (m1, p1), (m2, p2) = line.probes
    assert line.peak_gb(m1) == pytest.approx(p1)
    assert line.peak_gb(m2) == pytest.approx(p2)
    # two steps per probe (a warm-up, a measured one), the whole probe at once
    assert seen == [(1, (1, 64))] * 2 + [(16, (16, 64))] * 2


def test_the_larger_probe_is_at_most_the_largest_batch():
    seen: list[tuple[int, tuple[int, ...]]] = []
    step = _embedding_step(seen)
    line = measure_memory_line(step, (), length=8, vocab=100, device=CPU, largest=5)
    assert [k for k, _ in line.probes] == [1, 5]
    assert seen[-1] == (5, (5, 8))
    line = measure_memory_line(step, (), length=8, vocab=100, device=CPU, largest=1)
    assert [k for k, _ in line.probes] == [1]


def test_the_probe_is_random_tokens_of_the_shape_and_the_global_rng_is_untouched():
    batches: list[torch.Tensor] = []

    def keep(ids):
        batches.append(ids.clone())
        return {"input_ids": ids}

    def make(m):
        return lambda batch: batch["input_ids"].float().sum()

    torch.manual_seed(1234)
    state = torch.get_rng_state()
    line = measure_memory_line(make, (), length=7, vocab=50, device="cpu", examples=8, batch=keep)
    assert torch.equal(torch.get_rng_state(), state)
    assert [tuple(b.shape) for b in batches] == [(1, 7), (8, 7)]
    assert all(b.dtype == torch.long and int(b.min()) >= 0 and int(b.max()) < 50 for b in batches)
    first = list(batches)
    batches.clear()
    measure_memory_line(make, (), length=7, vocab=50, device="cpu", examples=8, batch=keep)
    assert all(torch.equal(a, b) for a, b in zip(first, batches, strict=True))  # seeded per size
    assert [k for k, _ in line.probes] == [1, 8]


def _oom_above(limit):
    def make(m):
        def step(ids):
            if ids.shape[0] > limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated) for {ids.shape[0]}")
            return ids.float().sum()

        return step

    return make


def test_a_larger_probe_that_does_not_fit_falls_back_to_a_quarter():
    line = measure_memory_line(_oom_above(4), (), length=8, vocab=10, device=CPU)
    assert [k for k, _ in line.probes] == [1, 4]
    assert math.isfinite(line.per_example_gb)


def test_when_no_larger_probe_fits_each_example_costs_the_rest():
    line = measure_memory_line(_oom_above(1), (), length=8, vocab=10, device=CPU)
    assert [k for k, _ in line.probes] == [1]
    assert line.base_gb == line.probes[0][1]
    assert math.isinf(line.per_example_gb)


def test_one_example_that_does_not_fit_raises_the_tuners_error():
    with pytest.raises(NoMicrobatchFitsError, match="even 1 gave oom") as caught:
        measure_memory_line(_oom_above(0), (), length=8, vocab=10, device=CPU)
    assert caught.value.result.candidates[0].microbatch_size == 1


def test_one_example_as_the_largest_batch_is_its_own_line():
    line = measure_memory_line(_oom_above(1), (), length=8, vocab=10, device=CPU, examples=1)
    ((_, peak),) = line.probes
    assert (line.base_gb, line.per_example_gb) == (peak, 0.0)


def test_a_device_that_reports_no_peak_gives_an_unknown_line(monkeypatch):
    monkeypatch.setattr(_memory_line, "_probe", lambda *args, **kwargs: None)
    line = measure_memory_line(_oom_above(100), (), length=8, vocab=10, device=CPU)
    assert line == MemoryLine(base_gb=0.0, per_example_gb=math.inf, probes=())
