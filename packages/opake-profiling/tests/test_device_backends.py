"""The CUDA and MPS code paths, driven by a fake allocator (this machine has neither device).

The real devices are checked by tools/gpu/profiling_check.py; these tests pin the wiring: which
torch functions feed which figure, when the device is synchronised, and the MPS sampled-peak
semantics on torch < 2.13.
"""

from __future__ import annotations

import pytest
import torch

from opake.profiling import (
    ConfigurationError,
    PerfState,
    _devices,
    empty_cache,
    get_memory_stats,
    reset_peak_memory,
    step_perf,
)

GB = 1024**3


class FakeAllocator:
    def __init__(self, total: int = 80 * GB) -> None:
        self.current = 0
        self.peak = 0
        self.reserved = 0
        self.total = total
        self.syncs = 0
        self.emptied = 0

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)
        self.reserved = max(self.reserved, self.current)

    def free(self, n: int) -> None:
        self.current -= n

    def sync(self, *args: object) -> None:
        self.syncs += 1

    def reset(self, *args: object) -> None:
        self.peak = self.current

    def empty(self) -> None:
        self.emptied += 1
        self.reserved = self.current


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeAllocator()
    seen_indices: list[int] = []

    def idx(i: int) -> int:
        seen_indices.append(i)
        return i

    def reading(value: str):
        return lambda i=None: (idx(i), getattr(fake, value))[1]

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "synchronize", lambda i=None: fake.sync(idx(i)))
    monkeypatch.setattr(cuda, "memory_allocated", reading("current"))
    monkeypatch.setattr(cuda, "memory_reserved", reading("reserved"))
    monkeypatch.setattr(cuda, "max_memory_allocated", reading("peak"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda i=None: fake.reset(idx(i)))
    monkeypatch.setattr(
        cuda, "mem_get_info", lambda i=None: (fake.total - fake.reserved, fake.total)
    )
    monkeypatch.setattr(cuda, "empty_cache", fake.empty)
    fake.indices = seen_indices
    return fake


def test_cuda_figures_are_exact_allocator_figures(fake_cuda):
    fake_cuda.alloc(2 * GB)
    fake_cuda.alloc(6 * GB)
    fake_cuda.free(6 * GB)  # reserved stays at 8 GB: 2/8 efficiency
    stats = get_memory_stats("cuda:1")
    assert stats.device == "cuda:1"
    assert set(fake_cuda.indices) == {1}
    assert (stats.available, stats.process_level, stats.allocated_exact, stats.peak_exact) == (
        True,
        False,
        True,
        True,
    )
    assert stats.source == "CUDA caching allocator"
    assert (stats.allocated_gb, stats.reserved_gb, stats.peak_gb) == (2.0, 8.0, 8.0)
    assert stats.free_gb == 72.0
    assert stats.total_gb == 80.0
    assert stats.utilization() == pytest.approx(0.1)
    assert stats.efficiency() == pytest.approx(0.25)
    reset_peak_memory("cuda:1")
    assert get_memory_stats("cuda:1").peak_gb == 2.0
    empty_cache("cuda")
    assert fake_cuda.emptied == 1
    assert get_memory_stats("cuda").reserved_gb == 2.0
    assert get_memory_stats("cuda").device == "cuda:0"  # index resolved to the current device
    with pytest.raises(ConfigurationError, match="2 CUDA device"):
        get_memory_stats("cuda:2")


def test_cuda_step_perf_synchronises_and_scopes_peaks(fake_cuda):
    fake_cuda.alloc(1 * GB)
    fake_cuda.alloc(9 * GB)
    fake_cuda.free(9 * GB)  # a peak from before the step must not count
    with step_perf("cuda", batch_size=32) as perf:
        assert fake_cuda.syncs == 1  # synchronised at entry
        fake_cuda.alloc(4 * GB)
        perf.mark("forward")
        assert fake_cuda.syncs == 2  # and before every mark
        fake_cuda.alloc(2 * GB)
        fake_cuda.free(6 * GB)
        perf.mark("backward")
        fake_cuda.alloc(1 * GB)
    assert fake_cuda.syncs == 4  # and at exit
    r = perf.result
    assert r.device == "cuda:0"
    assert r.memory_peak_exact
    assert not r.memory_process_level
    fwd, bwd = r.marks
    assert (fwd.memory_peak_gb, fwd.memory_allocated_gb) == (5.0, 5.0)
    assert (bwd.memory_peak_gb, bwd.memory_allocated_gb) == (7.0, 1.0)
    assert r.memory_peak_gb == 7.0
    assert r.memory_allocated_gb == 2.0
    assert r.memory_reserved_gb == 10.0
    state = PerfState(device="cuda").add(r)
    assert state.max_memory_peak_gb == 7.0


@pytest.fixture
def fake_mps(monkeypatch):
    fake = FakeAllocator(total=16 * GB)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: fake.current)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: fake.reserved + GB)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: fake.total)
    monkeypatch.setattr(torch.mps, "synchronize", fake.sync)
    monkeypatch.setattr(torch.mps, "empty_cache", fake.empty)
    return fake


def test_mps_sampled_peak_is_logged_once(fake_mps, monkeypatch, caplog):
    monkeypatch.setattr(_devices, "_torch_at_least", lambda major, minor: False)
    monkeypatch.setattr(_devices, "_LOGGED_ONCE", set())
    with caplog.at_level("INFO", logger="opake.profiling"):
        get_memory_stats("mps")
        get_memory_stats("mps")
    logged = [r.getMessage() for r in caplog.records if r.name == "opake.profiling"]
    expected = (
        "mps: no torch.accelerator memory statistics (torch < 2.13): the peak is sampled at "
        "entry, marks and exit"
    )
    assert logged == [expected]


def test_mps_before_2_13_samples_the_peak(fake_mps, monkeypatch):
    monkeypatch.setattr(_devices, "_torch_at_least", lambda major, minor: False)
    with step_perf("mps", batch_size=4) as perf:
        fake_mps.alloc(3 * GB)
        fake_mps.free(3 * GB)  # between samples: a sampled peak cannot see it (documented)
        fake_mps.alloc(2 * GB)
        perf.mark("forward")  # sampled here: 2 GB
        fake_mps.alloc(1 * GB)
    r = perf.result
    assert not r.memory_peak_exact
    assert r.marks[0].memory_peak_gb == 2.0
    assert r.memory_peak_gb == 3.0  # the exit sample
    assert r.memory_reserved_gb == 4.0  # the Metal driver allocation (3 GB cached + 1 GB)
    assert fake_mps.syncs == 3
    stats = get_memory_stats("mps")
    assert not stats.peak_exact
    assert "sampled" in stats.source
    assert stats.allocated_exact
    assert stats.total_gb == 16.0
    assert stats.free_gb == 12.0


def test_mps_from_2_13_uses_accelerator_peak(fake_mps, monkeypatch):
    monkeypatch.setattr(_devices, "_torch_at_least", lambda major, minor: True)
    monkeypatch.setattr(_devices, "_accelerator_is", lambda kind: kind == "mps")
    acc = torch.accelerator
    monkeypatch.setattr(acc, "memory_allocated", lambda *a: fake_mps.current)
    monkeypatch.setattr(acc, "max_memory_allocated", lambda *a: fake_mps.peak)
    monkeypatch.setattr(acc, "reset_peak_memory_stats", fake_mps.reset)
    with step_perf("mps") as perf:
        fake_mps.alloc(3 * GB)
        fake_mps.free(3 * GB)  # the exact peak sees what sampling would miss
        fake_mps.alloc(2 * GB)
        perf.mark("forward")
    r = perf.result
    assert r.memory_peak_exact
    assert r.marks[0].memory_peak_gb == 3.0
    assert r.memory_peak_gb == 3.0
    stats = get_memory_stats("mps")
    assert stats.peak_exact
    assert stats.source.startswith("torch.accelerator")
