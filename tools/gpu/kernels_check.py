"""GPU check of opake-kernels: Triton kernels for real (no interpreter), then the CUDA benchmark.

    python3 tools/gpu/kernels_check.py               # writes $OUT/kernels_gpu.md (./gpu_out)
    python3 tools/gpu/kernels_check.py --budget 200  # start no new step after 200 s
    python tools/gpu/kernels_check.py --dry-run-cpu   # tiny sizes, Triton interpreter, no GPU

Self-contained: runs from a bare checkout (adds ``packages/*/src`` to ``sys.path`` and registers
the kernels plugin by hand, since nothing is pip-installed there). Needs torch with CUDA, triton,
pluggy and packaging (all in the H200 image); liger-kernel is used only if importable.

Steps, most important first; each is recorded (pass/fail, figures, time) in the markdown as soon
as it ends, and a step is skipped when the time budget is spent:

1. environment (GPU, versions, which backend automatic selection picks on CUDA);
2. linear cross-entropy on realistic sizes, triton and chunked vs an fp32 reference
   (fp32 and bf16; values and gradients; ignored tokens, vocab not a multiple of the tile,
   softcap), and per-example weight gradients under ``vmap(grad())`` vs a per-example loop;
3. the CUDA benchmark: ``tools/bench/linear_ce.py --device cuda --dtype bf16`` (plain mode);
4. the same benchmark in vmap mode (per-example weight gradients);
5. ``opake.kernels.testing.check_backend`` for triton and chunked on CUDA, fp32 and bf16, every op.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from _step_report import ROOT, Report, package_sources

DRY = "--dry-run-cpu" in sys.argv  # exercise this script without a GPU (tiny, interpreted)
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)  # real kernels: unset before triton loads them

T0 = time.monotonic()
DEV = "cpu" if DRY else "cuda"


def _bootstrap() -> None:
    try:
        import opake.kernels  # noqa: F401
    except ImportError:
        sys.path[:0] = package_sources()
    from opake.core.plugins import kernel_backends, register_plugin

    if "triton" not in kernel_backends():
        import opake.kernels._plugin as plugin

        register_plugin(plugin, name="kernels")


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rel(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _environment() -> str:
    import torch
    import triton
    from torch.utils._triton import has_triton

    from opake.kernels import kernel_choice

    gpu = "none (dry run)" if DRY else torch.cuda.get_device_name()
    cap = None if DRY else torch.cuda.get_device_capability()
    lines = [
        f"- GPU: {gpu} (capability {cap})",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {sys.version[:6]}",
        f"- has_triton(): {has_triton()}",
    ]
    for op in ("linear_cross_entropy", "rms_norm"):
        c = kernel_choice(op, DEV)
        lines.append(f"- automatic choice for {op} on {DEV}: **{c.backend}** ({c.reason})")
    try:
        import liger_kernel  # noqa: F401

        lines.append("- liger-kernel: importable")
    except ImportError:
        lines.append("- liger-kernel: not installed (its benchmark row shows the import error)")
    return "\n".join(lines)


def _lce_accuracy() -> str:
    import torch
    from torch.func import grad, vmap

    from opake.kernels import linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    rows = [
        (
            "| backend | dtype | case | loss rel. err | grad hidden rel. err "
            "| grad weight rel. err | limit | ok |"
        ),
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    failures = []
    cases = [
        ("fp32", torch.float32, 1024, 512, 32003, 2e-5),
        ("bf16", torch.bfloat16, 2048, 1024, 32003, 2e-2),
    ]
    if DRY:
        cases = [("fp32", torch.float32, 40, 32, 90, 2e-5)]
    for backend in ("triton", "chunked"):
        for name, dtype, t, h, v, limit in cases:
            hid = torch.randn(t, h, generator=gen).to(DEV, dtype)
            w = (torch.randn(v, h, generator=gen) * h**-0.5).to(DEV, dtype)
            y = torch.randint(0, v, (t,), generator=gen).to(DEV)
            y[::7] = -100
            kw = {"softcap": 30.0, "label_smoothing": 0.1}
            hh = hid.clone().requires_grad_(True)
            ww = w.clone().requires_grad_(True)
            loss = linear_cross_entropy(hh, ww, y, backend=backend, **kw)
            gh, gw = torch.autograd.grad(loss, (hh, ww))
            hf = hid.float().requires_grad_(True)
            wf = w.float().requires_grad_(True)
            ref = linear_cross_entropy(hf, wf, y, backend="torch", **kw)
            rh, rw = torch.autograd.grad(ref, (hf, wf))
            errs = (_rel(loss, ref), _rel(gh, rh), _rel(gw, rw))
            ok = max(errs) <= limit and bool(torch.isfinite(gw).all())
            rows.append(
                f"| {backend} | {name} | {t} tok, H {h}, V {v}, softcap, smoothing | "
                + " | ".join(f"{e:.2e}" for e in errs)
                + f" | {limit:g} | {'yes' if ok else 'NO'} |"
            )
            if not ok:
                failures.append(f"{backend} {name}")
            del hh, ww, hf, wf, gh, gw, rh, rw
            _empty_cache()
    # per-example weight gradients under vmap(grad()) against a per-example loop
    b, t, h, v = (3, 8, 32, 90) if DRY else (4, 128, 512, 8191)
    vcases = [("fp32", torch.float32, 2e-5), ("bf16", torch.bfloat16, 2e-2)][: 1 if DRY else 2]
    for backend in ("triton", "chunked"):
        for name, dtype, limit in vcases:
            hid = torch.randn(b, t, h, generator=gen).to(DEV, dtype)
            w = (torch.randn(v, h, generator=gen) * h**-0.5).to(DEV, dtype)
            y = torch.randint(0, v, (b, t), generator=gen).to(DEV)
            y[-1] = -100  # an all-ignored example: zero gradient
            y[0, :5] = -100

            def f(hh: Any, ww: Any, yy: Any, be: str = backend) -> Any:
                return linear_cross_entropy(hh, ww, yy, backend=be, softcap=20.0)

            with torch.no_grad():
                pgh, pgw = vmap(grad(f, argnums=(0, 1)), in_dims=(0, None, 0))(hid, w, y)
            worst = 0.0
            for i in range(b - 1):
                hf = hid[i].float().requires_grad_(True)
                wf = w.float().requires_grad_(True)
                ref = linear_cross_entropy(hf, wf, y[i], backend="torch", softcap=20.0)
                rh, rw = torch.autograd.grad(ref, (hf, wf))
                worst = max(worst, _rel(pgh[i], rh), _rel(pgw[i], rw))
            zero = float(pgw[-1].abs().max())
            ok = worst <= limit and zero == 0.0
            rows.append(
                f"| {backend} | {name} | vmap(grad) {b} examples x {t} tok, H {h}, V {v}: worst "
                f"per-example rel. err | — | {worst:.2e} | all-ignored example max grad "
                f"{zero:g} | {limit:g} | {'yes' if ok else 'NO'} |"
            )
            if not ok:
                failures.append(f"{backend} {name} vmap")
            del pgh, pgw
            _empty_cache()
    text = "\n".join(rows)
    if failures:
        raise AssertionError(f"accuracy limits exceeded: {failures}\n\n{text}")
    return text


def _bench(mode: str, out: Path) -> str:
    path = ROOT / "tools" / "bench" / "linear_ce.py"
    spec = importlib.util.spec_from_file_location("linear_ce_bench", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    md = out / f"bench_cuda_{mode}.md"
    argv = ["--device", "cuda", "--dtype", "bf16", "--modes", mode, "--repeats", "5",
            "--markdown", str(md), "--json", str(out / f"bench_cuda_{mode}.json")]  # fmt: skip
    if DRY:
        argv = ["--device", "cpu", "--dtype", "fp32", "--modes", mode, "--repeats", "1",
                "--methods", "naive,chunked,triton", "--tokens", "64", "--hidden", "32",
                "--vocab", "200", "--vmap-batch", "2", "--vmap-tokens", "16",
                "--vmap-hidden", "32", "--vmap-vocab", "200", "--markdown", str(md)]  # fmt: skip
    mod.main(argv)
    return md.read_text()


def _check_backend(backend: str) -> str:
    import torch

    from opake.kernels.testing import Sizes, check_backend

    sizes = Sizes(batch=3, tokens=40, hidden=96, vocab=1000, heads=2, head_dim=64)
    dtypes = (torch.float32, torch.bfloat16)
    if DRY:
        sizes, dtypes = Sizes(), (torch.float32,)
    report = check_backend(backend, device=DEV, dtypes=dtypes, sizes=sizes)
    return "\n".join(f"- {line}" for line in report)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    p.add_argument("--budget", type=float, default=225.0, help="seconds; later steps are skipped")
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "kernels_gpu.md", "opake-kernels GPU check", start=T0)
    _bootstrap()
    import torch

    if not torch.cuda.is_available() and not DRY:
        report.add("No CUDA device: nothing to check.")
        return 1
    report.step("Environment", _environment, args.budget, needs=5)
    report.step("Linear cross-entropy accuracy (real Triton kernels)", _lce_accuracy,
                args.budget, needs=40)  # fmt: skip
    report.step("Benchmark, plain mode (bf16)", lambda: _bench("plain", args.out),
                args.budget, needs=50)  # fmt: skip
    report.step("Benchmark, vmap mode: per-example weight gradients (bf16)",
                lambda: _bench("vmap", args.out), args.budget, needs=50)  # fmt: skip
    report.step("check_backend('triton') on CUDA, every op, fp32 + bf16",
                lambda: _check_backend("triton"), args.budget, needs=40)  # fmt: skip
    report.step("check_backend('chunked') on CUDA, every op, fp32 + bf16",
                lambda: _check_backend("chunked"), args.budget, needs=15)  # fmt: skip
    report.add(f"Total {time.monotonic() - T0:.0f} s; {report.failures} step(s) failed.")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
