"""The fused clip-and-accumulate op (opake-kernels' Triton backend) on CUDA: equal to the torch
path of the clipping engine, and its time.

    python tools/gpu/clip_kernel_check.py

Per-example gradients of a Llama-like set of leaves (fp32 and bf16), factors with a zeroed
non-finite example; prints the max error against the torch path (fp64 reference) and the median
time of both paths. Exits non-zero when the kernel disagrees.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from opake.dpsgd.clipping import _kernel as _clip_kernel
from opake.kernels import kernel_choice


def _time(fn, *args, repeats: int = 20) -> float:
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    choice = kernel_choice("clip_accumulate", "cuda")
    print(f"clip_accumulate on cuda: backend {choice.backend!r} ({choice.reason})")
    if not _clip_kernel.kernel_runs_on(torch.device("cuda")):
        print("the fused kernel is not selected on this machine")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, hidden, layers = 16, 512, 4
    shapes = [(hidden, hidden)] * (4 * layers) + [(hidden,)] * (2 * layers) + [(3 * hidden, hidden)]
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.randn(m, *s, device="cuda", generator=gen).to(dtype) for s in shapes]
        grads[0][3].fill_(float("nan"))
        factors = torch.rand(m, len(grads), device="cuda", generator=gen)
        factors[3] = 0.0
        sums = [torch.zeros(s, device="cuda") for s in shapes]
        assert _clip_kernel.clip_accumulate(grads, factors, sums) == "triton"
        for j, (g, s) in enumerate(zip(grads, sums, strict=True)):
            flat = g.reshape(m, -1).double().nan_to_num(0.0, 0.0, 0.0)
            want = (factors[:, j].double() @ flat).reshape(s.shape)
            worst = max(worst, float((s.double() - want).abs().max() / want.abs().max()))
        fused = _time(_clip_kernel.clip_accumulate, grads, factors, sums)
        torch_path = _time(_clip_kernel.torch_clip_accumulate, grads, factors, sums)
        numel = sum(g.numel() for g in grads)
        print(
            f"{dtype}: {len(grads)} leaves, {numel / 1e6:.1f}M per-example entries: fused "
            f"{fused * 1e3:.3f} ms, torch {torch_path * 1e3:.3f} ms ({torch_path / fused:.2f}x)"
        )
    print(f"max relative error vs fp64: {worst:.2e}")
    return 0 if worst < 1e-5 else 2


if __name__ == "__main__":
    sys.exit(main())
