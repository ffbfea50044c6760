"""tune_microbatch: budget choice on CPU, OOM recovery, privacy neutrality, table, plot, errors."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from opake.profiling import (
    ConfigurationError,
    InputTypeError,
    NoMicrobatchFitsError,
    OperationError,
    TuneResult,
    _cpu,
    _tuner,
    default_candidates,
    empty_cache,
    get_memory_stats,
    tune_microbatch,
)

MB = 1024**2 / 1024**3
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="exact CPU peaks need /proc (Linux)"
)

# The budget test runs in a fresh interpreter. Process-level peaks depend on the malloc heap the
# process has: after a thousand tests in one pytest process, glibc often serves these 64-128 MiB
# gradient tensors from free heap chunks (it checks its bins before it maps a chunk of its own),
# and freed heap chunks stay resident, so a candidate's peak then follows where the heap places
# its tensors rather than its microbatch size. A fresh process maps them on their own.
BUDGET_SCRIPT = r"""
import json, torch
from torch.func import grad, vmap
from opake.profiling import tune_microbatch

IN, OUT = 2048, 1024  # per-example gradients of 8 MiB each: memory grows with the microbatch


def per_example_step(microbatch_size):
    def loss(w, x):
        return torch.tanh(x @ w).sum()

    per_example = vmap(grad(loss), in_dims=(None, 0))

    def step(w, x):
        total = torch.zeros_like(w)
        for chunk in x.split(microbatch_size):
            g = per_example(w, chunk)  # [m, IN, OUT]: m x 8 MiB
            norms = g.flatten(1).norm(dim=1)
            g = g * (1.0 / norms.clamp(min=1.0)).view(-1, 1, 1)
            total += g.sum(0)
            del g
        return total

    return step


def as_dict(r):
    fields = ("microbatch_size", "status", "fits", "steps", "step_time_sec",
              "samples_per_second", "memory_peak_gb", "detail")
    return {
        "microbatch_size": r.microbatch_size,
        "memory_budget_gb": r.memory_budget_gb,
        "memory_process_level": r.memory_process_level,
        "memory_peak_exact": r.memory_peak_exact,
        "candidates": [{f: getattr(c, f) for f in fields} for c in r.candidates],
        "table": r.table(),
    }


gen = torch.Generator().manual_seed(0)
w, x = torch.randn(IN, OUT, generator=gen) * 0.01, torch.randn(16, IN, generator=gen)
# Calibrate: with an ample budget every size fits; the peaks grow with the microbatch.
sweep = tune_microbatch(per_example_step, (w, x), batch_size=16, device="cpu",
                        memory_budget_gb=1000.0, steps=1, compare_smaller=2)
peaks = {c.microbatch_size: c.memory_peak_gb for c in sweep.candidates}
# A budget between the peaks of 8 and 16 must choose 8.
budget = (peaks[8] + peaks[16]) / 2
result = tune_microbatch(per_example_step, (w, x), batch_size=16, device="cpu",
                         memory_budget_gb=budget, steps=2, compare_smaller=1)
print(json.dumps({"sweep": as_dict(sweep), "budget": budget, "result": as_dict(result)}))
"""


@needs_proc
@pytest.mark.slow
def test_budget_picks_the_largest_size_that_fits():
    out = subprocess.run(
        [sys.executable, "-c", BUDGET_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    sweep, budget, result = report["sweep"], report["budget"], report["result"]
    assert [c["microbatch_size"] for c in sweep["candidates"]] == [16, 8, 4]
    assert all(c["fits"] for c in sweep["candidates"])
    assert sweep["microbatch_size"] == 16
    peaks = {c["microbatch_size"]: c["memory_peak_gb"] for c in sweep["candidates"]}
    # the gradient term: 8 more examples x 8 MiB, for the per-example grads and their clipped copy
    assert peaks[16] - peaks[8] >= 2 * 8 * 8 * MB * 0.9
    assert budget == pytest.approx((peaks[8] + peaks[16]) / 2)
    assert result["microbatch_size"] == 8, f"{sweep['table']}\n{result['table']}"
    candidates = {c["microbatch_size"]: c for c in result["candidates"]}
    statuses = [(c["microbatch_size"], c["status"]) for c in result["candidates"]]
    assert statuses == [(16, "over budget"), (8, "fits"), (4, "fits")]
    over = candidates[16]
    assert over["steps"] == 1  # stopped after the warm-up step that went over
    assert over["step_time_sec"] is None
    assert "> " in over["detail"]
    chosen = candidates[8]
    assert chosen["memory_peak_gb"] <= budget
    assert chosen["memory_peak_gb"] == pytest.approx(peaks[8], abs=16 * MB)
    assert chosen["steps"] == 3  # one warm-up + two smoke steps
    assert chosen["step_time_sec"] > 0
    assert chosen["samples_per_second"] == pytest.approx(16 / chosen["step_time_sec"])
    assert result["memory_budget_gb"] == budget
    assert result["memory_process_level"]
    assert result["memory_peak_exact"]


@needs_proc
@pytest.mark.skipif(_cpu._malloc_trim() is None, reason="needs glibc malloc (malloc_trim)")
def test_cpu_steps_do_not_count_what_earlier_steps_left_on_the_heap(monkeypatch):
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # Make the heap hold a large free region, as a long session leaves it: glibc raises its mmap
    # threshold to the size of a freed mapped chunk, so 8 MiB blocks then come from the heap; the
    # last block stays allocated, so the region below it stays on the heap once freed.
    libc.free(libc.malloc(16 * 1024**2))
    blocks = [libc.malloc(8 * 1024**2) for _ in range(16)]
    pin = blocks.pop()
    for block in blocks:
        libc.free(block)
    try:
        probe = torch.ones(96 * 1024**2 // 4)
        held = _cpu._read_proc_status()["VmRSS"]
        del probe
        if _cpu._read_proc_status()["VmRSS"] < held - 48 * 1024**2:
            pytest.skip("this malloc maps a 96 MiB tensor on its own even with room on the heap")

        def make(m):
            calls = {"n": 0}

            def step(x):  # 96 MiB in the first step, 32 MiB after: freed to the heap each time
                calls["n"] += 1
                t = torch.ones((96 if calls["n"] == 1 else 32) * 1024**2 // 4)
                return x.sum() + t[0]

            return step

        contexts = []
        real_step_perf = _tuner.step_perf

        def recording_step_perf(*args, **kwargs):
            contexts.append(real_step_perf(*args, **kwargs))
            return contexts[-1]

        monkeypatch.setattr(_tuner, "step_perf", recording_step_perf)
        tune_microbatch(
            make,
            (torch.ones(2),),
            batch_size=2,
            device="cpu",
            candidates=[2],
            memory_budget_gb=1000.0,
            steps=2,
        )
        monkeypatch.undo()
        peaks = [c.result.memory_peak_gb for c in contexts]
        assert len(peaks) == 3  # one warm-up + two smoke steps
        # The first step's 96 MiB went back to the heap, resident until trimmed; the later steps'
        # peaks are their own 32 MiB, not the first step's leftovers.
        assert peaks[1] == pytest.approx(peaks[0] - 64 * MB, abs=8 * MB)
        assert peaks[2] == pytest.approx(peaks[1], abs=4 * MB)
    finally:
        libc.free(pin)


def _hog_factory(limit: int, hog_mib: int, alive: list, fail_at_step: int = 1):
    """A step that holds ``hog_mib`` MiB and runs out of memory above ``limit`` (simulated)."""

    def make(m: int):
        calls = {"n": 0}

        def step(x):
            calls["n"] += 1
            hog = torch.ones(hog_mib * 1024**2 // 4)
            alive.append(weakref.ref(hog))
            if m > limit and calls["n"] >= fail_at_step:
                try:
                    raise RuntimeError("inner failure the OOM is chained to")
                except RuntimeError as inner:
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory (simulated). Tried to allocate for microbatch {m}"
                    ) from inner
            return x.sum() + hog[0]

        return step

    return make


@needs_proc
def test_simulated_oom_recovers_cleanly(monkeypatch):
    cleaned: list[bool] = []
    real_clean = _tuner._clean

    def counting_clean(device, *, full):
        cleaned.append(full)
        real_clean(device, full=full)

    monkeypatch.setattr(_tuner, "_clean", counting_clean)
    alive: list = []
    x = torch.ones(16, 4)
    empty_cache("cpu")
    gc.collect()
    before = get_memory_stats("cpu").allocated_gb
    result = tune_microbatch(
        _hog_factory(limit=4, hog_mib=64, alive=alive),
        (x,),
        batch_size=16,
        device="cpu",
        memory_budget_gb=1000.0,
        steps=2,
        compare_smaller=1,
    )
    after = get_memory_stats("cpu").allocated_gb
    assert result.microbatch_size == 4
    assert [(c.microbatch_size, c.status, c.steps) for c in result.candidates] == [
        (16, "oom", 0),
        (8, "oom", 0),
        (4, "fits", 3),
        (2, "fits", 3),
    ]
    oom = result.candidate(16)
    assert oom.detail.startswith("step 1: OutOfMemoryError: CUDA out of memory (simulated)")
    assert oom.memory_peak_gb is None
    assert oom.step_time_sec is None
    # no tensor the failed steps created is still alive (the traceback frames were dropped) ...
    assert alive
    assert all(ref() is None for ref in alive)
    # ... the cache was emptied after every candidate ...
    assert cleaned == [True] + [False] * len(result.candidates) + [True]
    # ... and the process holds what it held before (each failed step held 64 MiB)
    assert after == pytest.approx(before, abs=16 * MB)


def test_oom_after_warmup_is_unstable():
    alive: list = []
    result = tune_microbatch(
        _hog_factory(limit=2, hog_mib=1, alive=alive, fail_at_step=3),
        (torch.ones(8, 2),),
        batch_size=8,
        device="cpu",
        steps=3,
        compare_smaller=0,
    )
    assert [(c.microbatch_size, c.status, c.steps) for c in result.candidates] == [
        (8, "unstable", 2),
        (4, "unstable", 2),
        (2, "fits", 4),
    ]
    assert result.microbatch_size == 2
    assert result.candidate(8).step_time_sec is not None  # one smoke step was timed
    assert all(ref() is None for ref in alive)


def test_cpu_allocator_runtime_error_counts_as_oom():
    def make(m):
        def step(x):
            if m > 2:
                raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")
            return x

        return step

    result = tune_microbatch(make, (1,), batch_size=4, device="cpu", steps=1, compare_smaller=0)
    assert [c.status for c in result.candidates] == ["oom", "fits"]


def test_choice_and_fallbacks_are_logged(caplog):
    def make(m):
        def step(x):
            if m > 2:
                raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")
            return x

        return step

    with caplog.at_level("INFO", logger="opake.profiling"):
        tune_microbatch(make, (1,), batch_size=4, device="cpu", steps=1, compare_smaller=0)
    messages = [r.getMessage() for r in caplog.records if r.name == "opake.profiling"]
    assert any("using the current RSS plus 80% of the free memory" in m for m in messages)
    assert any("microbatch 4 on cpu does not fit (oom" in m for m in messages)
    assert messages[-1] == "tune_microbatch: chose microbatch 2 of batch 4 on cpu"
    caplog.clear()
    with caplog.at_level("INFO", logger="opake.profiling"):
        tune_microbatch(make, (1,), batch_size=2, device="cpu", steps=1, memory_budget_gb=64.0)
    messages = [r.getMessage() for r in caplog.records if r.name == "opake.profiling"]
    assert not any("free memory" in m for m in messages)  # a given budget is not a fallback
    assert messages == ["tune_microbatch: chose microbatch 2 of batch 2 on cpu"]


def test_other_errors_propagate():
    def make(m):
        def step(x):
            raise ValueError(f"a bug in the step (microbatch {m})")

        return step

    with pytest.raises(ValueError, match="a bug in the step"):
        tune_microbatch(make, (1,), batch_size=4, device="cpu", steps=1)


def test_nothing_fits_raises_with_the_measurements():
    def make(m):
        return lambda x: x

    with pytest.raises(NoMicrobatchFitsError) as info:
        tune_microbatch(make, (1,), batch_size=4, device="cpu", memory_budget_gb=1e-6, steps=1)
    err = info.value
    assert isinstance(err, OperationError)
    assert "no microbatch size fits on cpu: even 1 gave over budget" in str(err)
    assert isinstance(err.result, TuneResult)
    assert err.result.microbatch_size is None
    assert [c.status for c in err.result.candidates] == ["over budget"] * 3
    assert "nothing fits" in err.result.table()


def test_stateful_grad_fn_pair_threads_the_state():
    seen: list[tuple[int, int]] = []

    def make(m):
        def grad_fn(x, *, state):
            seen.append((m, state))
            return x * 2, state + 1

        return grad_fn, 100

    result = tune_microbatch(make, (torch.ones(2),), batch_size=4, device="cpu", steps=2)
    assert result.microbatch_size == 4
    assert seen[:3] == [(4, 100), (4, 101), (4, 102)]  # warm-up + 2 smoke steps
    assert seen[3] == (2, 100)  # every candidate starts from its own factory state


def test_kwargs_and_candidates():
    calls: list[tuple[int, float]] = []

    def make(m):
        def step(x, *, scale):
            calls.append((m, scale))
            return x * scale

        return step

    result = tune_microbatch(
        make,
        (torch.ones(3),),
        {"scale": 0.5},
        batch_size=12,
        device="cpu",
        candidates=[3, 12, 6, 6],
        steps=1,
        compare_smaller=5,
    )
    assert [c.microbatch_size for c in result.candidates] == [12, 6, 3]
    assert {s for _, s in calls} == {0.5}
    assert default_candidates(1) == (1,)
    assert default_candidates(10) == (10, 5, 2, 1)


def test_callback_sees_each_candidate():
    got = []
    tune_microbatch(
        lambda m: lambda x: x,
        (1,),
        batch_size=4,
        device="cpu",
        steps=1,
        callback=got.append,
    )
    assert [c.microbatch_size for c in got] == [4, 2, 1]


def test_table_and_plot(tmp_path):
    def make(m):
        def step(x):
            if m > 4:
                raise torch.OutOfMemoryError("simulated")
            return x

        return step

    png = tmp_path / "plots" / "tune.png"
    result = tune_microbatch(
        make, (1,), batch_size=16, device="cpu", steps=1, compare_smaller=2, plot=png
    )
    table = result.table()
    lines = table.splitlines()
    assert lines[0].split() == [
        "microbatch",
        "status",
        "steps",
        "step",
        "time",
        "samples/s",
        "peak",
        "memory",
    ]
    assert lines[2].split()[:3] == ["16", "oom", "0"]
    assert lines[4].endswith("<- chosen")
    assert lines[4].split()[:3] == ["4", "fits", "2"]
    assert lines[-1].startswith("cpu, batch 16, budget ")
    assert lines[-1].endswith("on process-level peak RSS: microbatch_size=4")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    with pytest.raises(ConfigurationError, match=r"\.png"):
        result.plot(tmp_path / "tune.svg")
    d = result.to_dict()
    assert d["microbatch_size"] == 4
    assert [c["status"] for c in d["candidates"]] == ["oom", "oom", "fits", "fits", "fits"]


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    import sys

    result = tune_microbatch(lambda m: lambda: None, (), batch_size=1, device="cpu", steps=1)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(OperationError, match=r"pip install 'opake-profiling\[plot\]'"):
        result.plot(tmp_path / "x.png")


def test_cpu_default_budget_is_rss_plus_most_of_free_memory():
    result = tune_microbatch(lambda m: lambda: None, (), batch_size=2, device="cpu", steps=1)
    stats = get_memory_stats("cpu")
    expected = stats.allocated_gb + _tuner.CPU_DEFAULT_FREE_FRACTION * stats.free_gb
    assert result.memory_budget_gb == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ConfigurationError, "batch_size=0"),
        ({"batch_size": 4.0}, InputTypeError, "batch_size"),
        ({"batch_size": 4, "steps": 0}, ConfigurationError, "steps=0"),
        ({"batch_size": 4, "candidates": [8]}, ConfigurationError, "exceeds batch_size=4"),
        ({"batch_size": 4, "candidates": []}, ConfigurationError, "at least one"),
        ({"batch_size": 4, "candidates": [0]}, ConfigurationError, ">= 1"),
        ({"batch_size": 4, "candidates": "4"}, InputTypeError, "candidates"),
        ({"batch_size": 4, "memory_budget_gb": -1.0}, ConfigurationError, "positive"),
        ({"batch_size": 4, "memory_budget_gb": float("nan")}, ConfigurationError, "finite"),
        ({"batch_size": 4, "memory_budget_gb": "8"}, InputTypeError, "memory_budget_gb"),
        ({"batch_size": 4, "device": "gpu0"}, InputTypeError, "device"),
        ({"batch_size": 4, "budget_gb": 1.0}, TypeError, "budget_gb"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(error, match=match):
        tune_microbatch(lambda m: lambda x: x, (1,), **kwargs)


def test_bad_factories():
    with pytest.raises(InputTypeError, match="make_grad_fn"):
        tune_microbatch(42, (), batch_size=2, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="args"):
        tune_microbatch(lambda m: print, "xy", batch_size=2, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="returned int"):
        tune_microbatch(lambda m: 3, (), batch_size=2, device="cpu")
    with pytest.raises(InputTypeError, match=r"\(grad_fn, state\)"):
        tune_microbatch(lambda m: (1, 2, 3), (), batch_size=2, device="cpu")


def test_choice_is_privacy_neutral():
    """Every microbatch size the tuner tries yields the same clipped gradient sum: the per-example
    loop reference (plain autograd, clip each example to C, sum in fp32)."""
    clipping = pytest.importorskip(
        "opake.dpsgd.clipping", reason="clipped_grad comes from opake-core (the [core] extra)"
    )
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    x = torch.randn(12, 5, generator=gen) * torch.linspace(0.05, 3.0, 12).view(-1, 1)
    y = torch.randint(0, 4, (12,), generator=gen)
    clip = 1.0

    def loss_fn(p, xi, yi):  # one example
        return torch.nn.functional.cross_entropy(xi @ p["w"] + p["b"], yi)

    # Reference: a per-example Python loop with plain autograd.
    ref = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in params.items()}
    norms = []
    for i in range(12):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        g = torch.autograd.grad(loss_fn(leaves, x[i], y[i]), list(leaves.values()))
        norm = torch.sqrt(sum(t.pow(2).sum() for t in g))
        norms.append(float(norm))
        scale = min(1.0, clip / float(norm))
        for k, t in zip(leaves, g, strict=True):
            ref[k] += t * scale
    assert min(norms) < clip < max(norms)  # some examples are clipped, some are not

    outputs: dict[int, dict[str, torch.Tensor]] = {}

    def make(m):
        grad_fn, state = clipping.clipped_grad(
            loss_fn, clipping_norm=clip, batch_argnums=(1, 2), microbatch_size=m
        )

        def recording(p, xs, ys, *, state):
            grads, new_state = grad_fn(p, xs, ys, state=state)
            outputs.setdefault(m, grads)
            return grads, new_state

        return recording, state

    result = tune_microbatch(
        make,
        (params, x, y),
        batch_size=12,
        device="cpu",
        candidates=[12, 8, 5, 3, 1],  # 8 and 5 leave a smaller last chunk
        steps=1,
        compare_smaller=4,
    )
    assert result.microbatch_size == 12
    assert sorted(outputs) == [1, 3, 5, 8, 12]
    for m, grads in outputs.items():
        assert grads.max_norm == clip, m  # same sensitivity whatever the chunking
        for k in params:
            assert grads[k].dtype == torch.float32
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"m={m} {k}")


@pytest.mark.parametrize(("budget", "line_drawn"), [(18.5, False), (0.9, True)])
def test_plot_keeps_the_memory_curve_readable_under_a_far_budget(budget, line_drawn):
    """A CPU default budget (most of free memory, 18.5 GB) once squashed peaks of ~0.5 GB into a
    flat line at the bottom of the panel: a budget far above every peak is written, not drawn."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from opake.profiling._tune_result import FITS, TuneCandidate, TuneResult

    peaks = {4: 0.62, 2: 0.55, 1: 0.5}
    candidates = tuple(TuneCandidate(m, FITS, 2, 0.1, 10.0 * m, p) for m, p in peaks.items())
    result = TuneResult(4, 4, "cpu", budget, candidates, memory_process_level=True)
    fig = Figure()
    result._draw(fig)
    ax_mem = fig.axes[0]
    low, high = ax_mem.get_ylim()
    assert high < 2.0 * budget if line_drawn else high < 1.0
    assert high - low > 0.05  # the curve's own range fills the panel
    texts = [t.get_text() for t in ax_mem.texts]
    assert any("off scale" in t for t in texts) is not line_drawn
