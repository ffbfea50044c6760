"""Peak memory of per-example gradients with and without Opake's vmap-safe checkpointing.

Each configuration runs in a fresh Python process (so the peak resident set size, RSS, belongs to
that configuration alone): a 4-layer Llama built from a config (hidden 256, sequence 1024,
batch 4, eager attention, no download), per-example gradients with ``vmap(grad(...))`` under
``torch.no_grad()``, HF ``gradient_checkpointing_enable()`` on or off. It reports the peak RSS of
the process, the RSS before the step (model, inputs, imports) and the step's own increase, and
checks that both configurations give the same per-example gradients. The step's increase is
measured from the kernel's peak-RSS mark (VmHWM), reset just before the step.

    python tools/bench/checkpoint_memory.py                  # CPU, default shape
    python tools/bench/checkpoint_memory.py --device cuda    # also the peak CUDA allocation
    python tools/bench/checkpoint_memory.py --device cuda --offload   # + save_on_cpu(pin_memory)
    python tools/bench/checkpoint_memory.py --json out.json
    python tools/bench/checkpoint_memory.py --mmap-threshold 131072   # RSS tracks live tensors

glibc keeps freed heap memory resident and raises its mmap threshold as large blocks are freed,
so by default the peak RSS also counts allocator slack; ``--mmap-threshold`` fixes
``MALLOC_MMAP_THRESHOLD_`` in the child processes so large tensors are returned to the system as
soon as they are freed (both configurations get the same setting).

Results are recorded in docs/benchmarks.md ("Checkpointing under vmap").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return _peak_rss_mib()


def run_one(args: argparse.Namespace) -> dict[str, object]:
    """One configuration, in this process."""
    import warnings

    import torch
    from torch.func import functional_call, grad, vmap
    from transformers import LlamaConfig, LlamaForCausalLM

    from opake.patches import apply_runtime_patches

    apply_runtime_patches()
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "max_position_embeddings": args.seq,
        "use_cache": False,
        "attn_implementation": "eager",
    }
    device = torch.device(args.device)
    model: Any = LlamaForCausalLM(LlamaConfig(**options))
    model.to(device)
    model.train()
    if args.checkpoint:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable()
    params = {k: v.detach() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x[None],), {"labels": x[None], "use_cache": False})
        value: torch.Tensor = out.loss
        return value

    per_example = vmap(grad(loss), in_dims=(None, 0))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    hwm_reset = _reset_hwm()
    base_rss = _rss_mib()
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        if args.offload_child
        else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    with offload, torch.no_grad():
        grads = per_example(params, ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak_rss = round(_peak_rss_mib(), 1)
    result: dict[str, object] = {
        "checkpoint": args.checkpoint,
        "save_on_cpu": args.offload_child,
        "seconds": round(seconds, 2),
        "rss_before_step_mib": round(base_rss, 1),
        "peak_rss_mib": peak_rss,
    }
    # the step's own peak: VmHWM was reset just before it (falls back to the process peak)
    step_peak = _hwm_mib() if hwm_reset else peak_rss
    result["step_rss_increase_mib"] = round(step_peak - base_rss, 1)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_peak_allocated_mib"] = round(peak, 1)
        result["cuda_step_increase_mib"] = round(peak - base, 1)
    # a fingerprint of the per-example gradients, compared across the two processes
    result["grad_fingerprint"] = [
        float(grads[k].double().norm(dim=tuple(range(1, grads[k].dim()))).sum())
        for k in sorted(grads)
    ]
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also run checkpointing inside save_on_cpu (hidden states kept on the host)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ (bytes) in the child processes",
    )
    parser.add_argument("--child", choices=["on", "off", "offload"], help=argparse.SUPPRESS)
    return parser


def _report(
    results: dict[str, dict[str, Any]], shape: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The children's results, their ratios and how far the gradients' fingerprints differ."""
    off, on = results["off"], results["on"]
    fp_off = off.pop("grad_fingerprint")
    max_rel = 0.0
    for other in results.values():
        if "grad_fingerprint" in other:
            fp = other.pop("grad_fingerprint")
            rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(fp_off, fp, strict=True)]
            max_rel = max(max_rel, *rel)
    import torch
    import transformers

    report: dict[str, Any] = {
        "shape": dict(a.split("=", 1) for a in (s.lstrip("-") for s in shape)),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "malloc_mmap_threshold": args.mmap_threshold,
        **results,
        "peak_rss_ratio": round(float(off["peak_rss_mib"]) / float(on["peak_rss_mib"]), 2),
        "step_increase_ratio": round(
            float(off["step_rss_increase_mib"]) / max(float(on["step_rss_increase_mib"]), 1.0), 2
        ),
        "grad_fingerprint_max_rel_diff": max_rel,
    }
    if "cuda_peak_allocated_mib" in off:
        for mode in results:
            if mode != "off":
                report[f"cuda_peak_ratio_{mode}"] = round(
                    float(off["cuda_peak_allocated_mib"])
                    / float(results[mode]["cuda_peak_allocated_mib"]),
                    2,
                )
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child is not None:
        args.checkpoint = args.child in ("on", "offload")
        args.offload_child = args.child == "offload"
        print(json.dumps(run_one(args)))
        return 0

    shape = [
        f"--{k}={getattr(args, k)}"
        for k in ("layers", "hidden", "intermediate", "heads", "vocab", "seq", "batch", "device")
    ]
    results = {}
    for mode in ("off", "on", "offload") if args.offload else ("off", "on"):
        cmd = [sys.executable, __file__, *shape, f"--child={mode}"]
        env = dict(os.environ)
        if args.mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    report = _report(results, shape, args)
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
