"""get_memory_stats / print_memory / reset_peak_memory / empty_cache on CPU, and their flags."""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest
import torch

import opake.profiling
from opake.profiling import (
    InputTypeError,
    MemoryStats,
    _cpu,
    empty_cache,
    get_memory_stats,
    print_memory,
    reset_peak_memory,
)

MB = 1024**2 / 1024**3  # one MiB in GiB
HAS_PROC = Path("/proc/self/status").exists()


def _rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1024**3


def test_cpu_stats_are_process_level_and_flagged():
    stats = get_memory_stats("cpu")
    assert isinstance(stats, MemoryStats)
    assert stats.device == "cpu"
    assert stats.available
    assert stats.process_level
    assert not stats.allocated_exact  # RSS is not "bytes in tensors"
    assert "process RSS" in stats.source
    # RSS agrees with psutil's reading to within a few MiB
    assert stats.allocated_gb == pytest.approx(_rss_gb(), abs=16 * MB)
    assert stats.reserved_gb == pytest.approx(stats.allocated_gb, abs=16 * MB)
    assert stats.peak_gb >= stats.allocated_gb - 1 * MB
    assert 0 < stats.free_gb < stats.total_gb
    assert 0 < stats.utilization() < 1
    assert stats.efficiency() is None  # no allocator cache to compare with on CPU
    keys = stats.to_dict(prefix="mem/")
    assert set(keys) == {
        "mem/memory_allocated_gb",
        "mem/memory_reserved_gb",
        "mem/memory_peak_gb",
        "mem/memory_free_gb",
        "mem/memory_total_gb",
        "mem/memory_utilization",
    }


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_cpu_peak_resets_and_tracks_an_allocation(fresh_block):
    reset_peak_memory("cpu")
    before = get_memory_stats("cpu")
    assert before.peak_exact
    assert "VmHWM since last reset" in before.source
    assert before.peak_gb == pytest.approx(before.allocated_gb, abs=4 * MB)
    big = fresh_block(64)  # 64 MiB of fresh pages, touched
    during = get_memory_stats("cpu")
    big.free()
    after = get_memory_stats("cpu")
    assert during.allocated_gb - before.allocated_gb == pytest.approx(64 * MB, abs=8 * MB)
    assert after.peak_gb - before.peak_gb == pytest.approx(64 * MB, abs=8 * MB)
    assert after.allocated_gb < during.allocated_gb - 48 * MB  # freed back to the system
    reset_peak_memory("cpu")
    assert get_memory_stats("cpu").peak_gb < after.peak_gb - 48 * MB


def test_cpu_peak_falls_back_to_sampling_when_reset_is_not_permitted(monkeypatch, tmp_path):
    monkeypatch.setattr(_cpu, "_PROC_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    reset_peak_memory("cpu")
    stats = get_memory_stats("cpu")
    assert not stats.peak_exact
    assert "sampled" in stats.source
    assert stats.peak_gb >= stats.allocated_gb - 1 * MB
    big = torch.ones(32 * 1024**2 // 4)
    sampled = get_memory_stats("cpu")  # a sample while the tensor is alive
    del big
    later = get_memory_stats("cpu")
    assert later.peak_gb == pytest.approx(sampled.allocated_gb, abs=4 * MB)


def test_cpu_sampling_fallback_is_logged_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(_cpu, "_PROC_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    with caplog.at_level("INFO", logger="opake.profiling"):
        reset_peak_memory("cpu")
        reset_peak_memory("cpu")
    logged = [r.getMessage() for r in caplog.records if r.name == "opake.profiling"]
    assert len(logged) == 1
    assert logged[0].startswith("cpu: the kernel's peak RSS cannot be reset here")
    assert "peaks after a reset are sampled" in logged[0]


def test_proc_descriptors_retry_transient_failures_and_remember_permanent_ones(
    monkeypatch, tmp_path
):
    status = tmp_path / "status"
    status.write_bytes(b"VmRSS:\t  2048 kB\nVmHWM:\t  4096 kB\n")
    monkeypatch.setattr(_cpu, "_PROC_STATUS", str(status))
    real_open = os.open
    calls = []

    def flaky_open(path, flags, *args):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)

    monkeypatch.setattr(_cpu.os, "open", flaky_open)
    assert _cpu._read_proc_status() is None  # out of descriptors: not remembered
    assert _cpu._read_proc_status() == {"VmRSS": 2048 * 1024, "VmHWM": 4096 * 1024}
    assert _cpu._read_proc_status() is not None
    assert len(calls) == 2  # the descriptor is kept once open

    # a failed read forgets (and closes) the descriptor: the next call reopens it
    def failing_pread(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_cpu.os, "pread", failing_pread)
    assert _cpu._read_proc_status() is None
    monkeypatch.undo()
    monkeypatch.setattr(_cpu, "_PROC_STATUS", str(status))
    assert _cpu._read_proc_status() == {"VmRSS": 2048 * 1024, "VmHWM": 4096 * 1024}
    # a file that does not exist is remembered as missing (no open per call)
    missing = str(tmp_path / "none")
    monkeypatch.setattr(_cpu, "_PROC_STATUS", missing)
    assert _cpu._read_proc_status() is None
    assert _cpu._PROC_FDS[(os.getpid(), missing, os.O_RDONLY)] is None
    for key in [k for k in _cpu._PROC_FDS if k[1] in (str(status), missing)]:
        fd = _cpu._PROC_FDS.pop(key)
        if fd is not None:
            os.close(fd)


def test_cpu_without_proc_uses_psutil(monkeypatch, tmp_path):
    monkeypatch.setattr(_cpu, "_PROC_STATUS", str(tmp_path / "no_status"))
    stats = get_memory_stats("cpu")
    assert stats.allocated_gb == pytest.approx(_rss_gb(), abs=16 * MB)
    # before any reset the lifetime peak (getrusage) is exact
    assert stats.peak_exact == (sys.platform != "win32")
    reset_peak_memory("cpu")
    assert not get_memory_stats("cpu").peak_exact


def test_cgroup_limit_caps_total_and_free(monkeypatch, tmp_path):
    limit, current = 2 * 1024**3, 1024**3 + 512 * 1024**2
    (tmp_path / "memory.max").write_text(f"{limit}\n")
    (tmp_path / "memory.current").write_text(f"{current}\n")
    monkeypatch.setattr(_cpu, "_CGROUP_MAX", str(tmp_path / "memory.max"))
    monkeypatch.setattr(_cpu, "_CGROUP_CURRENT", str(tmp_path / "memory.current"))
    stats = get_memory_stats("cpu")
    assert stats.total_gb == pytest.approx(2.0)
    assert stats.free_gb == pytest.approx(0.5)
    (tmp_path / "memory.max").write_text("max\n")
    assert get_memory_stats("cpu").total_gb > 0.5  # no limit: the machine's figures


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the missing-CUDA path")
def test_missing_backend_never_raises():
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        stats = get_memory_stats(device)
        assert not stats.available
        assert stats.allocated_gb is None
        assert stats.peak_gb is None
        assert stats.utilization() is None
        assert stats.to_dict() == {}
        reset_peak_memory(device)
        empty_cache(device)
    buf = io.StringIO()
    print_memory("cuda", "gpu", file=buf)
    assert buf.getvalue().strip() == (
        "[gpu] cuda: memory statistics not available (backend missing in this torch build or "
        "machine)"
    )


@pytest.mark.parametrize("bad", ["foo", "cuda:x", "", 3, None, 1.5, "meta"])
def test_bad_device_raises_input_type_error(bad):
    with pytest.raises(InputTypeError) as info:
        get_memory_stats(bad)
    assert "expected" in str(info.value) or "meta" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_errors_are_opake_core_errors_when_installed():
    from opake.core import errors

    assert opake.profiling.InputTypeError is errors.InputTypeError
    assert opake.profiling.ConfigurationError is errors.ConfigurationError
    assert opake.profiling.OperationError is errors.OperationError


def test_errors_without_opake_core(monkeypatch):
    # Load _errors.py as a fresh module while opake.core.errors cannot be imported.
    monkeypatch.setitem(sys.modules, "opake.core.errors", None)
    path = Path(opake.profiling.__file__).with_name("_errors.py")
    spec = importlib.util.spec_from_file_location("_opake_profiling_errors_standalone", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from opake.core import errors as core_errors

    assert module.InputTypeError is not core_errors.InputTypeError
    assert issubclass(module.InputTypeError, (module.OpakeError, TypeError))
    assert issubclass(module.ConfigurationError, (module.OpakeError, ValueError))
    assert issubclass(module.OperationError, (module.OpakeError, RuntimeError))
    assert issubclass(module.NoMicrobatchFitsError, module.OperationError)


def test_print_memory_prints_one_labelled_line(capsys):
    stats = print_memory(torch.device("cpu"), "start")
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith("[start] cpu [process-level, process RSS")
    assert f"allocated {stats.allocated_gb:.3f} GB" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_empty_cache_returns_freed_heap_on_cpu():
    if _cpu._malloc_trim() is None:
        pytest.skip("this libc has no malloc_trim")
    # glibc raises its mmap threshold to the size of a freed mapped chunk: after this, 256 KiB
    # tensors come from the malloc heap instead of mappings of their own
    bump = torch.ones(1024**2 // 4)
    del bump
    # Start from a trimmed heap: free chunks that earlier tests left resident would otherwise
    # serve the tensors below without the RSS growing at all. After the trim their pages are
    # fresh again, so the tensors touch new pages wherever on the heap they land.
    empty_cache("cpu")
    before = get_memory_stats("cpu").allocated_gb
    # many small tensors live on the malloc heap, not in their own mappings
    small = [torch.ones(64 * 1024) for _ in range(256)]  # 256 x 256 KiB = 64 MiB
    del small[:-1]  # freed heap chunks below the last one stay resident until trimmed
    held = get_memory_stats("cpu").allocated_gb
    empty_cache("cpu")
    trimmed = get_memory_stats("cpu").allocated_gb
    del small
    assert held - before > 32 * MB
    assert trimmed < held - 32 * MB


@pytest.mark.skipif(not HAS_PROC or not hasattr(os, "fork"), reason="needs /proc and fork")
def test_a_forked_child_reads_its_own_figures():
    parent_before = _cpu._read_proc_status()  # opens and keeps the parent's descriptor
    assert parent_before is not None
    import psutil

    hog_bytes = 256 * 1024**2
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: grow by 256 MiB; its figures must show it, the parent's would not
        try:  # (no torch here: its thread pools do not survive a fork)
            os.close(read_fd)
            before = _cpu._read_proc_status()["VmRSS"]
            hog = b"\x01" * hog_bytes  # a fresh mapping, every page touched
            after = _cpu._read_proc_status()["VmRSS"]
            truth = psutil.Process().memory_info().rss
            os.write(write_fd, f"{before} {after} {truth} {len(hog)}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        child_before, child_after, truth, _ = (int(v) for v in fh.read().split())
    os.waitpid(pid, 0)
    parent_after = _cpu._read_proc_status()["VmRSS"]
    # Through the inherited (parent's) descriptor the child would read the parent, which sits
    # idle in a pipe read: no growth. (Absolute RSS cannot tell the two apart: a forked child
    # does not count the parent's file-backed pages until it touches them, so its RSS can be
    # well below the parent's even with the 256 MiB it adds.)
    assert child_after - child_before == pytest.approx(hog_bytes, abs=16 * 1024**2)
    assert child_after == pytest.approx(truth, abs=4 * 1024**2)
    assert parent_after - parent_before["VmRSS"] < 64 * 1024**2  # the parent never held the hog
