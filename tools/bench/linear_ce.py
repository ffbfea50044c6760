"""Benchmark linear cross-entropy: the naive path against Opake's kernels and other baselines.

    python tools/bench/linear_ce.py                              # CPU, fp32 (recorded figures)
    python tools/bench/linear_ce.py --device cuda --dtype bf16   # GPU: adds triton (and liger)
    python tools/bench/linear_ce.py --markdown out.md --json out.json

One training step is forward + backward of the mean token loss. Two modes:

* ``plain``: ``loss.backward()`` over all tokens; gradients of hidden and weight.
* ``vmap``: ``vmap(grad(loss, argnums=weight))`` over examples: one weight gradient *per
  example* (what DP-SGD needs), each example's loss the mean over its own tokens.

Methods: ``naive`` (``F.linear`` then ``F.cross_entropy`` on fp32 logits, as Hugging Face
models do), ``chunked`` and ``triton`` (``opake.kernels.linear_cross_entropy``),
``torch_chunked`` (PyTorch's own ``F.linear_cross_entropy`` chunked path, when this torch has it)
and ``liger`` (Liger-Kernel's fused linear cross-entropy, when importable; CUDA only).

CPU: every (method, mode) runs in a fresh Python process (``--rounds`` interleaves several runs of
every method, so a change in machine load affects them alike); memory is the peak resident set size
(``ru_maxrss``) minus the resident size just before the first step, i.e. everything the step
added, including the gradients it returns. CUDA: one process, ``torch.cuda.max_memory_allocated``
minus the allocation before the first step, times from CUDA events. Times are medians over
``--repeats`` steps (of every round) after ``--warmup`` steps; memory is the largest peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
CPU_METHODS = ("naive", "chunked", "torch_chunked")
CUDA_METHODS = ("naive", "chunked", "triton", "liger", "torch_chunked")
TARGET_MEMORY = 0.10  # chunked extra memory <= 10 % of naive's
TARGET_TIME = 1.30  # chunked time <= 1.3x naive's


@dataclass(frozen=True)
class Shape:
    """Sizes of one benchmark case."""

    batch: int  # examples (1 in plain mode: all tokens form one batch)
    tokens: int  # tokens per example
    hidden: int
    vocab: int


@dataclass
class Result:
    """One (method, mode) measurement."""

    method: str
    mode: str
    shape: Shape
    times_s: list[float] = field(default_factory=list)
    extra_bytes: int = 0
    output_bytes: int = 0
    error: str | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s) if self.times_s else float("nan")


def _dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _require_kernels() -> None:
    """Opake's kernel backends come from the installed ``opake-kernels`` distribution (its
    plugin entry point); say how to install it when they are missing."""
    try:
        from opake.core.plugins import kernel_backends

        found = "chunked" in kernel_backends()
    except ImportError:
        found = False
    if not found:
        raise SystemExit(
            "linear_ce.py needs Opake's kernels: pip install -e packages/opake-kernels (a "
            "checkout) or pip install opake-kernels"
        )


def _loss_fn(method: str) -> Callable[..., Any]:
    import torch
    import torch.nn.functional as F

    if method == "naive":
        return lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)
    if method in ("chunked", "triton"):
        from opake.kernels import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y, backend=method)
    if method == "torch_chunked":
        if not hasattr(F, "linear_cross_entropy"):
            raise RuntimeError(f"torch {torch.__version__} has no F.linear_cross_entropy")
        opts = torch.nn.LinearCrossEntropyOptions()
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=opts)
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: fused(w, h, y)
    raise ValueError(f"unknown method {method!r}")


def _inputs(shape: Shape, mode: str, device: str, dtype: Any, seed: int) -> tuple[Any, Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lead = (shape.batch * shape.tokens,) if mode == "plain" else (shape.batch, shape.tokens)
    hidden = torch.randn(*lead, shape.hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen) * shape.hidden**-0.5).to(
        device, dtype
    )
    labels = torch.randint(0, shape.vocab, lead, generator=gen)
    labels[torch.rand(lead, generator=gen) < 0.05] = -100  # some padding
    return hidden, weight, labels.to(device)


def _make_step(method: str, mode: str, shape: Shape, device: str, dtype: Any, seed: int) -> Any:
    """Return ``(step, output_bytes)``; ``step()`` runs forward + backward once."""
    import torch
    from torch.func import grad, vmap

    fn = _loss_fn(method)
    hidden, weight, labels = _inputs(shape, mode, device, dtype, seed)
    if mode == "plain":
        hidden.requires_grad_(True)
        weight.requires_grad_(True)

        def step() -> None:
            hidden.grad = None
            weight.grad = None
            fn(hidden, weight, labels).backward()

        out = (hidden.numel() + weight.numel()) * hidden.element_size()
        return step, out

    per_example = vmap(grad(fn, argnums=1), in_dims=(0, None, 0))
    holder: list[Any] = []

    def vstep() -> None:
        holder.clear()
        with torch.no_grad():
            holder.append(per_example(hidden, weight, labels))

    return vstep, shape.batch * weight.numel() * weight.element_size()


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _first_use(method: str, mode: str, device: str, dtype: Any) -> None:
    """One tiny step first, so imports and one-time library set-up are not measured."""
    tiny, _ = _make_step(method, mode, Shape(2, 4, 16, 64), device, dtype, seed=1)
    tiny()


def _measure_cpu(res: Result, args: argparse.Namespace) -> None:
    _first_use(res.method, res.mode, "cpu", _dtype(args.dtype))
    step, res.output_bytes = _make_step(
        res.method, res.mode, res.shape, "cpu", _dtype(args.dtype), args.seed
    )
    base = _rss_bytes()
    for _ in range(args.warmup):
        step()
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        res.times_s.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res.extra_bytes = max(0, peak - base)


def _measure_cuda(res: Result, args: argparse.Namespace) -> None:
    import torch

    _first_use(res.method, res.mode, "cuda", _dtype(args.dtype))
    torch.cuda.empty_cache()
    step, res.output_bytes = _make_step(
        res.method, res.mode, res.shape, "cuda", _dtype(args.dtype), args.seed
    )
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    for _ in range(args.repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        step()
        end.record()
        end.synchronize()
        res.times_s.append(start.elapsed_time(end) / 1000.0)
    res.extra_bytes = max(0, torch.cuda.max_memory_allocated() - base)


def _shapes(args: argparse.Namespace) -> dict[str, Shape]:
    return {
        "plain": Shape(1, args.tokens, args.hidden, args.vocab),
        "vmap": Shape(args.vmap_batch, args.vmap_tokens, args.vmap_hidden, args.vmap_vocab),
    }


def _in_process(method: str, mode: str, args: argparse.Namespace) -> Result:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    res = Result(method, mode, _shapes(args)[mode])
    try:
        (_measure_cuda if args.device == "cuda" else _measure_cpu)(res, args)
    except Exception as err:  # recorded, not raised: one failing baseline must not stop the rest
        first = (str(err).splitlines() or [""])[0][:120]
        res.error = f"{type(err).__name__}: {first}"
        res.times_s = []
    return res


def _worker(args: argparse.Namespace) -> None:
    res = _in_process(args.worker, args.mode, args)
    print("RESULT " + json.dumps({**asdict(res), "median_s": res.median_s}))


def _from_json(data: dict[str, Any]) -> Result:
    data = dict(data)
    data.pop("median_s", None)
    data["shape"] = Shape(**data["shape"])
    return Result(**data)


def _run_fresh_process(method: str, mode: str, args: argparse.Namespace) -> Result:
    cmd = [sys.executable, __file__, "--worker", method, "--mode", mode]
    for name in (
        "device", "dtype", "hidden", "vocab", "tokens", "vmap_batch", "vmap_tokens",
        "vmap_hidden", "vmap_vocab", "repeats", "warmup", "seed", "threads",
    ):  # fmt: skip
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return _from_json(json.loads(line[len("RESULT ") :]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return Result(method, mode, _shapes(args)[mode], error=f"worker failed: {tail[0][:120]}")


def _machine(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({args.threads or torch.get_num_threads()} threads)"
    )


def _table(results: list[Result], args: argparse.Namespace) -> str:
    lines = []
    for mode in args.modes:
        rows = [r for r in results if r.mode == mode]
        if not rows:
            continue
        shape = rows[0].shape
        naive = next((r for r in rows if r.method == "naive" and r.error is None), None)
        what = (
            f"{shape.tokens} tokens"
            if mode == "plain"
            else f"{shape.batch} examples x {shape.tokens} tokens, per-example weight grads"
        )
        lines += [
            f"**{mode}** — hidden {shape.hidden}, vocab {shape.vocab}, {what}, {args.dtype}",
            "",
            (
                "| method | median step (s) | time vs naive | extra memory (MiB) "
                "| memory vs naive | extra beyond returned grads (MiB) | vs naive |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if r.error:
                lines.append(f"| {r.method} | — | — | — | — | — | {r.error} |")
                continue
            beyond = max(0, r.extra_bytes - r.output_bytes)
            if naive is not None:
                nb = max(1, naive.extra_bytes - naive.output_bytes)
                t = f"{r.median_s / naive.median_s:.2f}x"
                m = f"{100 * r.extra_bytes / max(1, naive.extra_bytes):.1f} %"
                b = f"{100 * beyond / nb:.1f} %"
            else:
                t = m = b = "—"
            lines.append(
                f"| {r.method} | {r.median_s:.3f} | {t} | {r.extra_bytes / MIB:.0f} | {m} "
                f"| {beyond / MIB:.0f} | {b} |"
            )
        lines.append("")
    return "\n".join(lines)


def _verdict(results: list[Result]) -> list[str]:
    out = []
    for mode in ("plain", "vmap"):
        by = {r.method: r for r in results if r.mode == mode and r.error is None}
        if "naive" not in by or "chunked" not in by:
            continue
        n, c = by["naive"], by["chunked"]
        time_ratio = c.median_s / n.median_s
        if mode == "plain":
            mem_ratio = c.extra_bytes / max(1, n.extra_bytes)
            what = "extra memory"
        else:  # both must return batch x (V, H) gradients: compare what comes on top of them
            mem_ratio = max(0, c.extra_bytes - c.output_bytes) / max(
                1, n.extra_bytes - n.output_bytes
            )
            what = "extra memory beyond the per-example gradients"
        ok_m = mem_ratio <= TARGET_MEMORY
        ok_t = time_ratio <= TARGET_TIME
        out.append(
            f"{mode}: chunked {what} = {100 * mem_ratio:.1f} % of naive "
            f"(target <= {100 * TARGET_MEMORY:.0f} %: {'met' if ok_m else 'NOT met'}); "
            f"time = {time_ratio:.2f}x naive (target <= {TARGET_TIME}x: "
            f"{'met' if ok_t else 'NOT met'})"
        )
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    p.add_argument("--methods", default=None, help="comma-separated; default depends on device")
    p.add_argument("--modes", default="plain,vmap")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--vmap-batch", type=int, default=None)
    p.add_argument("--vmap-tokens", type=int, default=None)
    p.add_argument("--vmap-hidden", type=int, default=None)
    p.add_argument("--vmap-vocab", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=1, help="runs of every method, interleaved")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    return p


def _fill_defaults(args: argparse.Namespace) -> None:
    """The sizes not given: the issue's setting on CPU, a Llama-3-8B-sized head on CUDA."""
    cuda = args.device == "cuda"
    defaults = {
        "dtype": "bf16" if cuda else "fp32",
        "hidden": 4096 if cuda else 512,
        "vocab": 128256 if cuda else 32000,
        "tokens": 8192 if cuda else 2048,
        # vmap: the same total tokens split into examples
        "vmap_batch": 8,
        "vmap_tokens": 1024 if cuda else 256,
        "vmap_hidden": 4096 if cuda else 512,
        "vmap_vocab": 128256 if cuda else 32000,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _measure(args: argparse.Namespace, methods: list[str]) -> list[Result]:
    """Every (mode, method), ``--rounds`` times interleaved; all steps and the largest peak."""
    cuda = args.device == "cuda"
    results: list[Result] = []
    for mode in args.modes:
        merged: dict[str, Result] = {}
        for rnd in range(args.rounds):  # methods interleaved: drifting load hits all alike
            for method in methods:
                if cuda:  # one process: CUDA peak memory is reset per method
                    res = _in_process(method, mode, args)
                else:  # RSS peaks need a fresh process per measurement
                    res = _run_fresh_process(method, mode, args)
                status = res.error or f"{res.median_s:.3f} s, extra {res.extra_bytes / MIB:.0f} MiB"
                print(f"[{mode:5s}] round {rnd + 1} {method:14s} {status}", flush=True)
                if method not in merged or merged[method].error:
                    merged[method] = res
                elif res.error is None:  # all steps of all rounds; the largest peak
                    merged[method].times_s += res.times_s
                    merged[method].extra_bytes = max(merged[method].extra_bytes, res.extra_bytes)
        results += [merged[m] for m in methods]
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _fill_defaults(args)
    _require_kernels()
    if args.worker:
        _worker(args)
        return 0
    args.modes = [m for m in args.modes.split(",") if m]
    default_methods = CUDA_METHODS if args.device == "cuda" else CPU_METHODS
    methods = args.methods.split(",") if args.methods else list(default_methods)
    results = _measure(args, methods)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python tools/bench/linear_ce.py", *given])
    text = "\n".join(
        [
            f"Machine: {_machine(args)}. Command: `{command}`",
            "",
            _table(results, args),
            *[f"- {line}" for line in _verdict(results)],
            "",
        ]
    )
    print("\n" + text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = [{**asdict(r), "median_s": r.median_s} for r in results]
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None, "markdown": None},
                                         "results": payload}, indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
