"""Where the memory of one training step goes: the peak RSS of each phase, and what it holds.

Runs ``--warmup`` steps, then one step of a ``tools/bench/dpsgd_step.py`` method (default: the
documented ``opake-user`` path and ``nonprivate``, each in its own process) with the process's peak
RSS reset (``/proc/self/clear_refs``, Linux) at every phase boundary, so each phase reports its own
peak: the RSS when it starts, its peak, and the growth over the RSS the step started at. Phases are
marked by wrapping the engine's functions: for a DP step ``forward`` (up to the backward call),
``backward``, ``norms`` (the per-example norms from the recorded pieces), ``clipped sum``, ``rest of
clipped_grad``, ``optimizer accumulate``, ``optimizer step`` (noise, the update); for the
non-private step ``forward``, ``backward``, ``optimizer step``. For the book-keeping engine it also
lists the bytes the recording holds when the backward ends, by kind (recorded inputs, output
gradients, kept outputs, implicit uses) counting each storage once, and the bytes of the parameters,
their ``.grad`` and the clipped-sum buffers.

    python tools/profile/step_memory.py --model smollm2 --batch 8 --seq 128 --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the DP-step workload

from _dpsgd_methods import method_step
from _dpsgd_workload import LR, build, workload
from _pretrained import resolve_model

MIB = 1024 * 1024


def _status(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _live_mib() -> float:
    """Bytes malloc has handed out and not taken back (heap in use + mmapped), MiB (glibc)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return float(info.uordblks + info.hblkhd) / MIB


class Sampler:
    """A thread that samples :func:`_live_mib` every millisecond (torch ops release the GIL)."""

    def __init__(self) -> None:
        self.peak = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, _live_mib())

    def take(self) -> float:
        """The peak since the last call (and now), then restart."""
        peak, self.peak = max(self.peak, _live_mib()), 0.0
        return peak


class Phases:
    """Per-phase peak RSS: ``mark(name)`` ends the current phase and starts ``name``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.current: str | None = None
        self.start_rss = 0.0
        self.started = 0.0
        self.live_start = 0.0
        self.live = False
        self.sampler: Sampler | None = None

    def _reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def mark(self, name: str | None) -> None:
        if not self.live:
            return
        now = _status("VmRSS")
        if self.current is not None:
            self.rows.append(
                {
                    "phase": self.current,
                    "rss_start_mib": self.start_rss,
                    "peak_mib": max(_status("VmHWM"), now),
                    "rss_end_mib": now,
                    "live_start_mib": self.live_start,
                    "live_peak_mib": self.sampler.take() if self.sampler else 0.0,
                    "cpu_s": time.process_time() - self.started,
                }
            )
        self.current = name
        self.start_rss = now
        self.live_start = _live_mib()
        if self.sampler:
            self.sampler.take()
        self.started = time.process_time()
        self._reset()


def _wrap(owner: Any, attr: str, before: Callable[[], None], after: Callable[[], None]) -> None:
    inner = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return inner(*args, **kwargs)
        finally:
            after()

    setattr(owner, attr, wrapper)


def _storage_bytes(tensors: list[Any], seen: set[int]) -> int:
    import torch

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _recording_bytes(uses: list[Any]) -> dict[str, float]:
    """Bytes the recorded uses hold, by kind; each storage counted once (first kind wins)."""
    import torch

    seen: set[int] = set()
    out = {"output gradients": 0, "recorded inputs": 0, "kept outputs": 0, "uses": len(uses)}
    for use in uses:
        out["output gradients"] += _storage_bytes([use.grad], seen)
    for use in uses:
        tensors = [a for a in use.args if isinstance(a, torch.Tensor)]
        tensors += [v for v in use.kwargs.values() if isinstance(v, torch.Tensor)]
        out["recorded inputs"] += _storage_bytes(tensors, seen)
        out["kept outputs"] += _storage_bytes([use.output], seen)
    return {k: (v / MIB if k != "uses" else v) for k, v in out.items()}


def _instrument(phases: Phases, info: dict[str, Any]) -> None:
    """Wrap the engine and optimizer functions that bound each phase."""
    import torch

    from opake.dpsgd.bookkeeping import _chunk, _runner
    from opake.dpsgd.optimizer import _dp_optimizer

    backward = torch.autograd.backward

    def marked_backward(*args: Any, **kwargs: Any) -> Any:
        phases.mark("backward")
        return backward(*args, **kwargs)

    torch.autograd.backward = marked_backward  # type: ignore[assignment]
    runner = _runner.BookkeepingRunner
    fb = runner._forward_backward

    def forward_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        phases.mark("forward")
        out = fb(self, *args, **kwargs)
        if phases.live:
            info["recording"] = _recording_bytes(out[2])
        phases.mark("norms")
        return out

    runner._forward_backward = forward_backward  # type: ignore[method-assign]
    _wrap(
        _chunk.BookkeepingChunk,
        "accumulate",
        lambda: phases.mark("clipped sum"),
        lambda: phases.mark("rest of clipped_grad"),
    )
    opt = _dp_optimizer.DPOptimizer

    _wrap(opt, "accumulate", lambda: phases.mark("optimizer accumulate"), lambda: None)
    _wrap(opt, "step", lambda: phases.mark("optimizer step"), lambda: phases.mark(None))


def _nonprivate_step(model: Any, ids: Any, phases: Phases) -> Callable[[], None]:
    import torch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        phases.mark("forward")
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        phases.mark("backward")
        loss.backward()
        phases.mark("optimizer step")
        opt.step()
        phases.mark(None)

    return step


def run_one(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method in this process: warm-up steps, then one step with per-phase peaks."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    work = workload(args)
    model, ids = build("full", work)
    phases = Phases()
    info: dict[str, Any] = {}
    if method == "nonprivate":
        step = _nonprivate_step(model, ids, phases)
    else:
        _instrument(phases, info)
        step, _ = method_step(method, model, ids, args, work)
    for _ in range(args.warmup):
        step()
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    grads = sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    before = _status("VmRSS")
    live_before = _live_mib()
    phases.sampler = Sampler()
    phases.live = True
    phases._reset()
    step()
    phases.mark(None)
    phases.live = False
    return {
        "method": method,
        "rss_before_step_mib": before,
        "live_before_step_mib": live_before,
        "params_mib": params,
        "grad_before_step_mib": grads / MIB,
        "phases": phases.rows,
        **info,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["nonprivate", "opake-user"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(args.worker, args)))
        return 0
    if args.model:
        args.model = resolve_model(args.model)
    for method in args.methods:
        cmd = [sys.executable, __file__, "--worker", method, "--warmup", str(args.warmup)]
        cmd += ["--threads", str(args.threads)]
        for flag in ("model", "batch", "seq", "microbatch_size"):
            value = getattr(args, flag)
            if value is not None:
                cmd += ["--" + flag.replace("_", "-"), str(value)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        result = json.loads(done.stdout.strip().splitlines()[-1])
        base = result["rss_before_step_mib"]
        print(
            f"\n## {method}: RSS before the step {base:.0f} MiB (parameters "
            f"{result['params_mib']:.0f} MiB, .grad {result['grad_before_step_mib']:.0f} MiB)"
        )
        live = result["live_before_step_mib"]
        print(f"malloc'd before the step {live:.0f} MiB")
        print(
            "| phase | RSS at start | RSS peak | RSS peak - before step | malloc'd at start |"
            " malloc'd peak | malloc'd peak - before step | CPU s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in result["phases"]:
            print(
                f"| {row['phase']} | {row['rss_start_mib']:.0f} | {row['peak_mib']:.0f} | "
                f"{row['peak_mib'] - base:+.0f} | {row['live_start_mib']:.0f} | "
                f"{row['live_peak_mib']:.0f} | {row['live_peak_mib'] - live:+.0f} | "
                f"{row['cpu_s']:.2f} |"
            )
        if "recording" in result:
            print("recording at the end of the backward (MiB):", json.dumps(result["recording"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
