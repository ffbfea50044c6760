"""GPU check of opake-profiling: exact CUDA figures, real out-of-memory recovery, overhead.

    python3 tools/gpu/profiling_check.py                 # writes $OUT/profiling_gpu.md (./gpu_out)
    python3 tools/gpu/profiling_check.py --budget 240     # start no new step after 240 s
    python tools/gpu/profiling_check.py --dry-run-cpu     # tiny sizes on CPU, no GPU needed

Self-contained: runs from a bare checkout (adds ``packages/*/src`` to ``sys.path``). Needs torch
with CUDA and psutil; transformers only for the optional Llama step (skipped without it).

Steps, most important first; each is recorded (ok/FAILED, figures, time) in the markdown as soon
as it ends, and a step is skipped when the time budget is spent:

1. environment;
2. memory figures: ``get_memory_stats`` against ``torch.cuda``; ``step_perf`` per-mark and per-step
   peaks for known allocations; a mark after queued kernels waits for them (CUDA events agree);
3. a *real* out-of-memory sweep: ``tune_microbatch`` over a step that needs ``m x 6 GiB`` plus a
   10 GiB hog; after it, allocated memory equals what it was before and the cache is emptied;
4. privacy neutrality on CUDA: ``clipped_grad`` sums for every microbatch size the tuner tries
   equal a per-example loop;
5. ``tools/bench/profiling_overhead.py`` on CUDA and CPU (an idle machine: the figures for
   docs/benchmarks.md);
6. the tuner on a Llama (hidden 512, 4 layers, vocabulary 32000, 256 tokens), if transformers is
   importable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _step_report import ROOT, Report, package_sources

DRY = "--dry-run-cpu" in sys.argv
T0 = time.monotonic()
DEV = "cpu" if DRY else "cuda"
GIB = 1024**3


def _bootstrap() -> None:
    try:
        import opake.dpsgd.clipping
        import opake.profiling  # noqa: F401
    except ImportError:
        sys.path[:0] = package_sources()


def _check(ok: bool, what: str) -> str:
    if not ok:
        raise AssertionError(what)
    return f"- ok: {what}"


def _environment() -> str:
    import torch

    import opake.profiling as prof

    lines = [f"- torch {torch.__version__}, python {sys.version.split()[0]}"]
    if not DRY:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- GPU: {props.name}, {props.total_memory / GIB:.1f} GiB")
    lines.append(f"- {prof.get_memory_stats(DEV).describe()}")
    return "\n".join(lines)


def _alloc(nbytes: int) -> Any:
    import torch

    if DRY:  # CPU figures are the process RSS: touch the pages
        return torch.ones(nbytes // 4)
    return torch.empty(nbytes // 4, device=DEV)


def _memory_figures() -> str:
    import torch

    from opake.profiling import get_memory_stats, reset_peak_memory, step_perf

    unit = GIB if not DRY else 64 * 1024**2
    tol = 0.01 if not DRY else 0.2
    lines = []
    base = get_memory_stats(DEV)
    if not DRY:
        lines.append(_check(base.peak_exact and not base.process_level, "CUDA figures are exact"))
    x = _alloc(unit)
    now = get_memory_stats(DEV)
    if not DRY:
        lines.append(
            _check(
                abs(now.allocated_gb - torch.cuda.memory_allocated() / GIB) < 1e-9
                and abs(now.reserved_gb - torch.cuda.memory_reserved() / GIB) < 1e-9,
                f"allocated/reserved equal torch.cuda's ({now.allocated_gb:.3f} GB)",
            )
        )
    grown = (now.allocated_gb - base.allocated_gb) * GIB / unit
    lines.append(_check(abs(grown - 1.0) < tol, f"a {unit / GIB:.3f} GB tensor adds {grown:.4f}x"))
    del x
    reset_peak_memory(DEV)
    start = get_memory_stats(DEV).allocated_gb
    with step_perf(DEV, batch_size=8) as perf:
        a = _alloc(2 * unit)
        del a
        perf.mark("two")
        b = _alloc(unit)
        perf.mark("one")
        del b
    r = perf.result
    u = unit / GIB
    lines.append(
        _check(
            abs(r.marks[0].memory_peak_gb - start - 2 * u) < tol * u
            and abs(r.marks[1].memory_peak_gb - start - u) < tol * u
            and abs(r.memory_peak_gb - start - 2 * u) < tol * u,
            f"mark peaks {r.marks[0].memory_peak_gb - start:.3f} / "
            f"{r.marks[1].memory_peak_gb - start:.3f} GB over the start, step peak "
            f"{r.memory_peak_gb - start:.3f} GB",
        )
    )
    if not DRY:
        n = 8192
        m1 = torch.randn(n, n, device="cuda")
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with step_perf("cuda") as perf:
            ev0.record()
            y = m1
            for _ in range(20):
                y = y @ m1
            ev1.record()
            perf.mark("matmuls")  # must wait for the queued kernels
        kernel_ms = ev0.elapsed_time(ev1)
        mark_ms = 1e3 * perf.result.marks[0].time_sec
        lines.append(
            _check(
                mark_ms >= 0.95 * kernel_ms,
                f"mark time {mark_ms:.1f} ms covers the kernels' {kernel_ms:.1f} ms (CUDA events)",
            )
        )
        del m1, y
    return "\n".join(lines)


def _real_oom() -> str:
    import torch

    from opake.profiling import empty_cache, get_memory_stats, tune_microbatch

    per_example = 6 * GIB if not DRY else 8 * 1024**2
    hog_bytes = 10 * GIB if not DRY else 16 * 1024**2
    fake_limit = None if not DRY else 100 * 1024**2

    def make(m: int) -> Any:
        def step(x: torch.Tensor) -> torch.Tensor:
            hog = torch.ones(hog_bytes // 4, device=DEV)
            if fake_limit is not None and m * per_example + hog_bytes > fake_limit:
                raise torch.OutOfMemoryError("simulated (dry run)")
            grads = torch.ones(m, per_example // 4, device=DEV)
            return (grads.sum() + hog[0] + x.sum()).detach()

        return step

    empty_cache(DEV)
    before = get_memory_stats(DEV)
    ooms0 = torch.cuda.memory_stats().get("num_ooms", 0) if not DRY else 0
    result = tune_microbatch(
        make, (torch.ones(4, device=DEV),), batch_size=64, device=DEV, steps=2, compare_smaller=1
    )
    after = get_memory_stats(DEV)
    ooms = (torch.cuda.memory_stats().get("num_ooms", 0) if not DRY else 0) - ooms0
    lines = ["```", result.table(), "```"]
    statuses = [c.status for c in result.candidates]
    fits = result.microbatch_size is not None
    lines.append(_check("oom" in statuses and fits, "out of memory first, then a size fits"))
    tol_gb = 1e-3 if not DRY else 0.016  # CPU (dry run): process RSS moves by a few MB
    lines.append(
        _check(
            abs(after.allocated_gb - before.allocated_gb) < tol_gb,
            f"allocated after {after.allocated_gb:.4f} GB == before {before.allocated_gb:.4f} GB",
        )
    )
    if not DRY:
        lines.append(
            _check(
                after.reserved_gb <= before.reserved_gb + 0.01,
                f"reserved after {after.reserved_gb:.3f} GB <= before {before.reserved_gb:.3f} GB "
                "+ 10 MB (cache emptied)",
            )
        )
        lines.append(f"- real CUDA out-of-memory errors during the sweep: {ooms}")
    return "\n".join(lines)


def _privacy_neutral() -> str:
    import torch

    from opake.dpsgd.clipping import clipped_grad
    from opake.profiling import tune_microbatch

    gen = torch.Generator().manual_seed(0)
    d_in, d_out, n = 64, 16, 48
    params = {
        "w": (torch.randn(d_in, d_out, generator=gen) * 0.3).to(DEV),
        "b": torch.zeros(d_out).to(DEV),
    }
    x = (torch.randn(n, d_in, generator=gen) * torch.linspace(0.05, 2.0, n).view(-1, 1)).to(DEV)
    y = torch.randint(0, d_out, (n,), generator=gen).to(DEV)

    def loss_fn(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(xi @ p["w"] + p["b"], yi)

    ref = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(n):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        g = torch.autograd.grad(loss_fn(leaves, x[i], y[i]), list(leaves.values()))
        norm = torch.sqrt(sum(t.pow(2).sum() for t in g))
        for k, t in zip(leaves, g, strict=True):
            ref[k] += t * torch.clamp(1.0 / norm, max=1.0)
    outputs: dict[int, Any] = {}

    def make(m: int) -> Any:
        grad_fn, state = clipped_grad(
            loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), microbatch_size=m
        )

        def recording(*args: Any, state: Any) -> Any:
            out = grad_fn(*args, state=state)
            outputs.setdefault(m, out[0])
            return out

        return recording, state

    tune_microbatch(
        make,
        (params, x, y),
        batch_size=n,
        device=DEV,
        candidates=[48, 32, 7, 1],
        steps=1,
        compare_smaller=3,
    )
    worst = 0.0
    for grads in outputs.values():
        for k in params:
            err = float((grads[k] - ref[k]).abs().max() / ref[k].abs().max())
            worst = max(worst, err)
    return _check(
        sorted(outputs) == [1, 7, 32, 48] and worst < 1e-5,
        f"sizes {sorted(outputs)}: max relative error vs the per-example loop {worst:.2e}",
    )


def _overhead(out_dir: Path) -> str:
    lines = []
    for device in ([] if DRY else ["cuda"]) + ["cpu"]:
        target = out_dir / f"profiling_overhead_{device}.json"
        cmd = [
            sys.executable,
            str(ROOT / "tools/bench/profiling_overhead.py"),
            "--device",
            device,
            "--repeats",
            "20" if DRY else "100",
            "--json",
            str(target),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*package_sources(), env.get("PYTHONPATH", "")])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        lines += [f"`{' '.join(cmd[1:])}`", "", "```", proc.stdout + proc.stderr[-2000:], "```"]
        if proc.returncode != 0:
            raise RuntimeError("\n".join(lines))
    return "\n".join(lines)


def _llama_tune() -> str:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        return f"skipped: transformers is not importable ({err})"
    import torch

    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional
    from opake.profiling import tune_microbatch

    hidden, layers, vocab, seq, batch = (512, 4, 32000, 256, 64) if not DRY else (32, 1, 128, 8, 4)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8 if not DRY else 2,
        num_key_value_heads=8 if not DRY else 2,
        max_position_embeddings=seq,
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager").to(DEV)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(tr: Any, fr: Any, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.unsqueeze(0)
        return fmodel((tr, fr), input_ids=ids, labels=ids, use_cache=False).loss

    def make(m: int) -> Any:
        return clipped_grad(loss_fn, argnums=0, clipping_norm=1.0, batch_argnums=2,
                            microbatch_size=m)  # fmt: skip

    probe = torch.randint(0, vocab, (batch, seq), device=DEV)
    result = tune_microbatch(
        make, (trainable, frozen, probe), batch_size=batch, device=DEV, steps=3, compare_smaller=3
    )
    n_params = sum(p.numel() for p in model.parameters())
    return f"{n_params / 1e6:.1f}M parameters, batch {batch} x {seq}\n\n```\n{result.table()}\n```"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for all steps")
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny sizes on CPU")
    args = parser.parse_args()
    _bootstrap()
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "profiling_gpu.md", "opake-profiling GPU check", start=T0)
    report.step("1. environment", _environment, args.budget, 5)
    report.step("2. memory figures and synchronisation", _memory_figures, args.budget, 20)
    report.step("3. real out-of-memory sweep and recovery", _real_oom, args.budget, 40)
    report.step("4. privacy neutrality on the device", _privacy_neutral, args.budget, 20)
    report.step("5. step_perf overhead", lambda: _overhead(out_dir), args.budget, 80)
    report.step("6. tuner on a Llama", _llama_tune, args.budget, 60)
    report.add(f"failures: {report.failures}; total {time.monotonic() - T0:.0f} s")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
