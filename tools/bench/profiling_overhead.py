"""Overhead of ``opake.profiling.step_perf`` (with marks) relative to a 50 ms training step.

    python tools/bench/profiling_overhead.py                 # CPU, and CUDA/MPS when present
    python tools/bench/profiling_overhead.py --device cpu --repeats 200 --json out.json

Three measurements, each a median over ``--repeats`` repetitions after a warm-up:

1. ``bookkeeping``: an empty step inside ``step_perf`` with ``--marks`` marks, minus an empty
   step without it: the fixed cost of entering, marking and exiting (device synchronisations
   included, which on an idle device cost next to nothing).
2. ``spin step``: a step that busy-waits exactly ``--step-ms`` ms, with and without
   ``step_perf`` (interleaved): the overhead as the user sees it, in a step whose own length
   does not vary.
3. ``torch step``: a real workload (float32 matmuls sized to about ``--step-ms`` ms), with and
   without ``step_perf`` (interleaved); noisier, since the work itself varies from step to step.

Each is reported with and without memory tracking, as wall time and as process CPU time (the
latter is what the profiler itself spends; wall time also catches synchronisation waits but is
noisy on a shared machine). The target (issue 7): overhead <= 2 % of a
50 ms step, i.e. <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _profiled(device: Any, marks: int, track: bool, body: Callable[[], None]) -> Callable[[], None]:
    from opake.profiling import step_perf

    names = [f"phase{i}" for i in range(marks)]

    def run() -> None:
        with step_perf(device, batch_size=8, track_memory=track) as perf:
            body()
            for name in names:
                perf.mark(name)
        _ = perf.result

    return run


def _paired(
    plain: Callable[[], None], wrapped: Callable[[], None], repeats: int
) -> dict[str, float]:
    for _ in range(3):
        plain()
        wrapped()
    base, prof = [], []
    for _ in range(repeats):  # interleaved, so drifts in machine load hit both alike
        base.append(_timed(plain))
        prof.append(_timed(wrapped))
    b, p = (statistics.median(t[0] for t in base), statistics.median(t[0] for t in prof))
    bc, pc = (statistics.median(t[1] for t in base), statistics.median(t[1] for t in prof))
    return {
        "plain_ms": 1e3 * b,
        "profiled_ms": 1e3 * p,
        "overhead_ms": 1e3 * (p - b),
        "overhead_cpu_ms": 1e3 * (pc - bc),
    }


def synchronizer(device: Any) -> Callable[[], None]:
    """A call that waits for the work queued on *device* (as ``step_perf`` does at each mark);
    it does nothing on the CPU."""
    import torch

    if device.type == "cpu":
        return lambda: None
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: torch.accelerator.synchronize(device)


def _matmul_body(device: Any, step_ms: float) -> Callable[[], None]:
    import torch

    sync = synchronizer(device)
    n = 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def body_k(k: int) -> Callable[[], None]:
        def body() -> None:
            x = a
            for _ in range(k):
                x = (x @ b).tanh_()
            sync()

        return body

    one = statistics.median(_timed(body_k(1))[0] for _ in range(10))
    k = max(1, round(step_ms / 1e3 / max(one, 1e-6)))
    return body_k(k)


def measure(device: Any, *, step_ms: float, marks: int, repeats: int) -> dict[str, Any]:
    sync = synchronizer(device)

    def empty() -> None:
        sync()

    out: dict[str, Any] = {"device": str(device), "step_ms": step_ms, "marks": marks}
    torch_body = _matmul_body(device, step_ms)
    for track in (True, False):
        key = "memory" if track else "time_only"
        spin_body = lambda: _spin(step_ms / 1e3)  # noqa: E731
        out[key] = {
            "bookkeeping": _paired(empty, _profiled(device, marks, track, empty), repeats),
            "spin_step": _paired(spin_body, _profiled(device, marks, track, spin_body), repeats),
            "torch_step": _paired(
                torch_body, _profiled(device, marks, track, torch_body), max(repeats // 4, 10)
            ),
        }
    return out


def _devices(choice: str | None) -> list[Any]:
    import torch

    if choice is not None:
        return [torch.device(choice)]
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda"))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append(torch.device("mps"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="one device (default: every one present)")
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--marks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    import platform

    import torch

    results = []
    print(
        f"step_perf overhead: torch {torch.__version__}, {platform.processor() or 'cpu'}, "
        f"{args.marks} marks per step, medians of {args.repeats} steps "
        f"({max(args.repeats // 4, 10)} for the torch step)"
    )
    header = f"{'device':<8} {'memory':<9} {'measurement':<12} {'plain':>10} {'profiled':>10} "
    header += f"{'overhead':>10} {'% of step':>9} {'CPU time':>10} {'% of step':>9}"
    print(header)
    print("-" * len(header))
    for device in _devices(args.device):
        res = measure(device, step_ms=args.step_ms, marks=args.marks, repeats=args.repeats)
        results.append(res)
        for key in ("memory", "time_only"):
            for name, row in res[key].items():
                step = row["plain_ms"] if name != "bookkeeping" else args.step_ms
                pct = 100 * row["overhead_ms"] / step
                pct_cpu = 100 * row["overhead_cpu_ms"] / step
                print(
                    f"{res['device']:<8} {key:<9} {name:<12} {row['plain_ms']:>8.3f}ms "
                    f"{row['profiled_ms']:>8.3f}ms {1e3 * row['overhead_ms']:>8.1f}us "
                    f"{pct:>8.3f}% {1e3 * row['overhead_cpu_ms']:>8.1f}us {pct_cpu:>8.3f}%"
                )
    print(
        f"(overhead = profiled - plain, medians; bookkeeping as % of a {args.step_ms:g} ms step. "
        f"CPU time: the process's CPU seconds, insensitive to preemption on a loaded machine. "
        f"Target: <= 2 %, i.e. <= {args.step_ms * 0.02:g} ms)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
