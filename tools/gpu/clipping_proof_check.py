"""The clipping bound's attacks on CUDA: each example's contribution ≤ C with cuBLAS's own
reduction orders (split-K, tensor-core paths off by TF32 being off), both engines.

    python tools/gpu/clipping_proof_check.py --out gpu_out/clipping_proof.json

Cases (as in ``packages/opake-core/tests/test_privacy_clipping_proof.py``): underflowing Gram
entries (tiny alternating inputs, huge alternating targets), tie absorption over 65 536
features, a 2²⁴-entry leaf on the vmap engine; each with flush-to-zero off (CUDA kernels may
flush on their own). Prints one line per case and writes the worst ratio contribution / C.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _norm(grads: Any) -> float:
    return math.sqrt(math.fsum(float(g.double().square().sum()) for g in grads.values()))


def _worst(grad_fn: Any, state: Any, args: tuple[Any, ...], batch: int, device: Any) -> float:
    import torch

    worst = 0.0
    for i in range(batch):
        mask = torch.zeros(batch, dtype=torch.bool, device=device)
        mask[i] = True
        got, _ = grad_fn(*args, state=state, example_mask=mask)
        worst = max(worst, _norm(got))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of the script)")
    args = parser.parse_args(argv)

    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dev = torch.device(args.device)
    results: dict[str, float] = {}

    def mse(fmodel: Any) -> Any:
        def losses(p: Any, x: Any, y: Any) -> Any:
            return ((fmodel(p, x) - y) ** 2).sum(dim=(1, 2))

        return BatchedLoss(losses, fmodel)

    torch.manual_seed(0)
    width, steps = 1024, 512
    layer = torch.nn.Linear(width, width).to(dev)
    fmodel, params = make_functional(layer)
    sign = torch.tensor([(-1.0) ** t for t in range(steps)], device=dev)[:, None]
    x = torch.randn(2, steps, width, device=dev) * 0.1
    y = torch.randn(2, steps, width, device=dev) * 0.1
    big = math.sqrt(3.4e38 / width) / 2
    x[1] = 1.0e-23 * torch.randn(width, device=dev).sign() * sign
    y[1] = -big * torch.randn(width, device=dev).sign() * sign
    for method in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            mse(fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine=method
        )
        results[f"underflow/{method}"] = _worst(grad_fn, state, (params, x, y), 2, dev)

    wide = 65536
    layer = torch.nn.Linear(wide, 4, bias=False).to(dev)
    fmodel, params = make_functional(layer)
    small = torch.full((wide - 1,), 2.0**-12, device=dev)
    one = torch.ones(1, device=dev)
    xt = torch.zeros(2, 2, wide, device=dev)
    xt[0] = torch.randn(2, wide, device=dev) * 0.01
    xt[1] = torch.stack([torch.cat([one, small]), torch.cat([one, -small])])
    yt = torch.zeros(2, 2, 4, device=dev)
    yt[0] = torch.randn(2, 4, device=dev)
    target = torch.tensor([1.0, -1.0, 0.5, 2.0], device=dev) * 1e3
    yt[1, 0], yt[1, 1] = target, -target
    grad_fn, state = clipped_grad(mse(fmodel), clipping_norm=1.0, batch_argnums=(1, 2))
    results["ties/auto"] = _worst(grad_fn, state, (params, xt, yt), 2, dev)

    n = 1 << 24
    w = {"w": torch.zeros(n, device=dev)}

    def long_loss(p: Any, xi: Any) -> Any:
        return (p["w"] * xi).sum()

    xl = torch.full((1, n), 2.0**-12, device=dev)
    xl[0, :4] = 1.0
    grad_fn, state = clipped_grad(long_loss, clipping_norm=1.0, batch_argnums=(1,), engine="vmap")
    results["long-leaf/vmap"] = _worst(grad_fn, state, (w, xl), 1, dev)

    bad = {k: v for k, v in results.items() if not v <= 1.0 + 1e-12}
    for name, value in results.items():
        print(f"{name}: contribution / C = {value:.9f}")
    print(f"clipping proof on {dev}:", "VIOLATED " + str(sorted(bad)) if bad else "holds")
    if args.out is not None:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else dev.type
        args.out.write_text(json.dumps({"device": name, **results}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
