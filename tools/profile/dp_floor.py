"""The least a DP step with exact per-example clipping and secure noise can cost on this machine.

    python tools/profile/dp_floor.py --threads 2                       # the benchmark Llama
    python tools/profile/dp_floor.py --model smollm2 --batch 8 --seq 128 --threads 2

A lower bound, measured, for the full fine-tuning DP step of ``tools/bench/dpsgd_step.py``
against its non-private step, built from work no exact DP step can skip:

- **the per-example norms' matrix products.** For every linear layer (and the tied head) the
  squared norm of each example's weight gradient ``Σ_t δ_t x_tᵀ`` needs either the Gram
  products (``T²·(in + out)`` multiply-adds per example, the input's Gram shared by the layers
  reading the same input) or the gradient itself (``T·in·out``). For each layer the cheaper
  of the two is timed as plain fp32 ``bmm`` at the layer's real shapes — no blocking, no fp64
  accumulation, no error terms, no cross terms of tied weights — so the real engine can only
  take longer;
- **the random bits of the noise**: 8 bytes of ChaCha20 keystream per parameter (fewer than
  53 random bits per Gaussian value cannot reach fp64 resolution), from the same secure
  source (``opake.dpsgd.randomness``);
- **one pass of the noise over the parameters** (an fp32 ``add_`` of a noise-sized buffer).

The non-private step (forward, backward, SGD) and the documented DP step
(``dpsgd_step.py``'s ``opake-user``) are timed in the same process, interleaved: median of
``--steps`` steps after one warm-up step, wall time. The floor ratio is
``(non-private + products + keystream + pass) / non-private``. A second line replaces the
keystream and the pass by the noise Opake draws (``GaussianNoise.add_`` from a secure key:
fp64 Box–Muller onto the lattice, which the floating-point guarantee of
``docs/guide/privacy-noise.md`` rests on): the floor of a DP step with *that* noise.

Recorded in docs/benchmarks.md ("Where the floor is").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the DP-step workload


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _linear_uses(model: Any, ids: Any) -> list[tuple[int, int, int, int, int]]:
    """``(batch, steps, in, out, input id)`` of every ``nn.Linear`` call of one forward (the
    id is the same for layers reading one input tensor: its Gram matrix is shared)."""
    import torch

    uses: list[tuple[int, int, int, int, int]] = []
    seen: dict[int, int] = {}

    def hook(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], _out: Any) -> None:
        x = inputs[0]
        key = seen.setdefault(x.data_ptr(), len(seen))
        batch, steps = int(x.shape[0]), int(x.shape[1])
        uses.append((batch, steps, module.in_features, module.out_features, key))

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return uses


def norm_products(uses: list[tuple[int, int, int, int, int]], repeats: int) -> tuple[float, int]:
    """Seconds of the cheapest exact per-example norm products of every layer (fp32 ``bmm``),
    and their multiply-adds."""
    import torch

    total, macs, shared = 0.0, 0, set()
    for batch, steps, rows_in, rows_out, key in uses:
        gram_in = 0 if key in shared else steps * steps * rows_in
        gram = gram_in + steps * steps * rows_out
        direct = steps * rows_in * rows_out
        if gram <= direct:
            shared.add(key)
            sides = [rows_out] + ([rows_in] if gram_in else [])
            for width in sides:
                x = torch.randn(batch, steps, width)
                total += _median_time(lambda x=x: torch.bmm(x, x.transpose(1, 2)), repeats)
            macs += batch * gram
        else:
            a, b = torch.randn(batch, rows_out, steps), torch.randn(batch, steps, rows_in)
            total += _median_time(lambda a=a, b=b: torch.bmm(a, b), repeats)
            macs += batch * direct
    return total, macs


def keystream_time(count: int) -> float:
    """Seconds to draw 8 bytes of secure keystream per value, in 2 MiB pieces written into one
    reused buffer (as the noise draw reads it)."""
    from opake.dpsgd.randomness import Randomness
    from opake.dpsgd.randomness._source import STREAMS, _fill

    key = Randomness.secure().export_key()
    piece = 1 << 21
    buf = memoryview(bytearray(piece))
    start = time.perf_counter()
    for offset in range(0, 8 * count, piece):
        _fill(key, STREAMS["noise"], 0, offset, buf[: min(piece, 8 * count - offset)])
    return time.perf_counter() - start


def noise_pass(params: list[Any], repeats: int) -> float:
    """Seconds of one fp32 ``add_`` of a noise buffer onto every parameter."""
    import torch

    buf = torch.randn(max(p.numel() for p in params))

    def run() -> None:
        for p in params:
            p.add_(buf[: p.numel()].view_as(p))

    with torch.no_grad():
        return _median_time(run, repeats)


def secure_noise(params: list[Any], repeats: int) -> float:
    """Seconds of the noise the documented DP step adds: ``GaussianNoise.add_`` from a secure
    key on fp32 sums of the parameters' shapes (keystream, fp64 Box–Muller, the lattice and
    the pass over the sums — ``docs/guide/privacy-noise.md``)."""
    import torch

    from opake.dpsgd.noise import GaussianNoise

    noise = GaussianNoise(1.0)
    sums = {f"p{i}": torch.zeros_like(p) for i, p in enumerate(params)}
    return _median_time(lambda: noise.add_(sums, sensitivity=1.0), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None, help="smollm2, a .gguf file or an HF directory")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from _dpsgd_methods import nonprivate_step, opake_user_step
    from _dpsgd_workload import build, workload

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or "benchmark Llama"
    if args.model is not None:
        from _pretrained import resolve_model

        args.model = resolve_model(args.model)
    work = workload(args)
    stock, ids = build("full", work)
    uses = _linear_uses(stock, ids)
    plain, _ = nonprivate_step(stock, ids)
    model, dp_ids = build("full", work)
    step, _ = opake_user_step(model, dp_ids, argparse.Namespace(microbatch_size=None), work, "auto")
    step()
    plain()
    totals: dict[str, list[float]] = {"DP step": [], "non-private step": []}
    for _ in range(args.steps):
        for label, fn in (("DP step", step), ("non-private step", plain)):
            start = time.perf_counter()
            fn()
            totals[label].append(time.perf_counter() - start)
    base = statistics.median(totals["non-private step"])
    dp = statistics.median(totals["DP step"])
    products, macs = norm_products(uses, repeats=5)
    params = [p.detach() for p in stock.parameters()]
    count = sum(p.numel() for p in params)
    keys = keystream_time(count)
    add = noise_pass(params, repeats=3)
    floor = base + products + keys + add
    drawn = secure_noise(params, repeats=3)
    proven = base + products + drawn
    print(f"{name}, batch {work.batch} × {work.seq}, {torch.get_num_threads()} threads, wall")
    print(f"  non-private step              {base * 1e3:9.1f} ms")
    print(f"  DP step (documented path)     {dp * 1e3:9.1f} ms   {dp / base:.3f}×")
    print(f"  norm products ({macs / 1e9:.2f} G MACs)  {products * 1e3:9.1f} ms")
    print(f"  keystream ({count / 1e6:.1f} M values)    {keys * 1e3:9.1f} ms")
    print(f"  one noise pass                {add * 1e3:9.1f} ms")
    print(f"  floor                         {floor * 1e3:9.1f} ms   {floor / base:.3f}×")
    print(f"  secure noise (GaussianNoise)  {drawn * 1e3:9.1f} ms")
    print(f"  floor with that noise         {proven * 1e3:9.1f} ms   {proven / base:.3f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
