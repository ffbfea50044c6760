"""GPU check of the DP training step: offload equality and memory, bf16/fp16 autocast, resume.

    python tools/gpu/training_step_check.py            # prints a JSON report, exit 1 on failure
    python tools/gpu/training_step_check.py --out f.json
    python tools/gpu/training_step_check.py --device cpu   # smoke run of the script itself

What it checks on one CUDA device (a few seconds):

1. ``DPOptimizer(offload_state=True)`` vs no offload, AdamW, 5 steps on an MLP (hidden 2048):
   parameters agree (the CPU and CUDA Adam kernels round differently, so the tolerance is fp32
   relative 1e-5, not bitwise), the optimizer state is on the CPU, and the peak CUDA memory of a
   step is lower with offload (the Adam moments, 2 × parameter bytes, are not on the device).
2. ``autocast_loss`` bf16 and fp16 (static loss scale) through ``clipped_grad`` on CUDA: the
   per-example gradients are fp32 and close to the fp32 ones; the fp16 scale is exact.
3. Resume: a checkpoint taken after 2 steps and loaded into fresh objects continues bitwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from opake.dpsgd.checkpoint import load_checkpoint, save_checkpoint
from opake.dpsgd.clipping import clipped_grad
from opake.dpsgd.optimizer import DPOptimizer, autocast_loss
from opake.functional import make_functional

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN = 2048


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 8),
    ).to(DEVICE)  # fmt: skip


def batch(n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 64, generator=gen).to(DEVICE),
        torch.randint(0, 8, (n,), generator=gen).to(DEVICE),
    )


def setup(model: torch.nn.Module, **kwargs: object):  # type: ignore[no-untyped-def]
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(tr, fr, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(fmodel((tr, fr), x[None]), y[None])

    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(2, 3),
                                  microbatch_size=8)  # fmt: skip
    opt = DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), trainable, noise_multiplier=1.0,
        expected_batch_size=16.0, seed=0, **kwargs,
    )  # fmt: skip
    return loss_fn, grad_fn, state, opt, trainable, frozen


def run_steps(model, grad_fn, state, opt, trainable, frozen, steps):  # type: ignore[no-untyped-def]
    peak = 0.0
    for step in range(steps):
        x, y = batch(seed=step)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _, state = opt.logical_step(grad_fn, trainable, [(frozen, x, y)], state=state)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**20)
    return state, peak


def check_offload() -> dict[str, object]:
    plain, off = mlp(), mlp()
    _, gf_p, st_p, opt_p, tr_p, fr_p = setup(plain)
    _, gf_o, st_o, opt_o, tr_o, fr_o = setup(off, offload_state=True)
    _, peak_plain = run_steps(plain, gf_p, st_p, opt_p, tr_p, fr_p, 5)
    _, peak_off = run_steps(off, gf_o, st_o, opt_o, tr_o, fr_o, 5)
    max_rel = max(
        float(((a.detach() - b.detach()).abs() / b.detach().abs().clamp_min(1e-6)).max())
        for a, b in zip(off.parameters(), plain.parameters(), strict=True)
    )
    state_devices = {
        v.device.type
        for s in opt_o.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    }
    ok = max_rel < 1e-4 and state_devices == {"cpu"}
    if DEVICE.type == "cuda":
        ok = ok and peak_off < peak_plain
    return {
        "ok": ok,
        "max_relative_param_difference": max_rel,
        "offload_state_devices": sorted(state_devices),
        "peak_step_mib_plain": round(peak_plain, 1),
        "peak_step_mib_offload": round(peak_off, 1),
    }


def check_autocast() -> dict[str, object]:
    model = mlp()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(tr, fr, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(fmodel((tr, fr), x[None]), y[None])

    x, y = batch()
    out: dict[str, object] = {}
    exact_fn, state = clipped_grad(loss_fn, clipping_norm=1e9, batch_argnums=(2, 3))
    exact, _ = exact_fn(trainable, frozen, x, y, state=state)
    ok = True
    for name, wrapped in (
        ("bf16", autocast_loss(loss_fn, torch.bfloat16)),
        ("fp16", autocast_loss(loss_fn, torch.float16, loss_scale=2.0**12)),
    ):
        fn, state = clipped_grad(wrapped, clipping_norm=1e9, batch_argnums=(2, 3))
        got, _ = fn(trainable, frozen, x, y, state=state)
        rel = max(float((got[k] - exact[k]).norm() / exact[k].norm().clamp_min(1e-12)) for k in got)
        dtypes = sorted({str(v.dtype) for v in got.values()})
        out[name] = {"relative_error_vs_fp32": rel, "dtypes": dtypes}
        ok = ok and dtypes == ["torch.float32"] and rel < 5e-2
    out["ok"] = ok
    return out


def check_resume() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.pt"
        a = mlp()
        _, gf, st, opt, tr, fr = setup(a)
        st, _ = run_steps(a, gf, st, opt, tr, fr, 2)
        save_checkpoint(path, step=2, model=a, optimizer=opt, clip_state=st)
        st, _ = run_steps(a, gf, st, opt, tr, fr, 1)  # step index 0 again: same data
        b = mlp(seed=9)
        _, gf_b, st_b, opt_b, tr_b, fr_b = setup(b)
        st_b = load_checkpoint(path, model=b, optimizer=opt_b, clip_state=st_b).clip_state
        run_steps(b, gf_b, st_b, opt_b, tr_b, fr_b, 1)
        equal = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    return {"ok": equal, "bitwise_equal": equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    report = {
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "offload": check_offload(),
        "autocast": check_autocast(),
        "resume": check_resume(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(report[k]["ok"] for k in ("offload", "autocast", "resume")) else 1


if __name__ == "__main__":
    sys.exit(main())
