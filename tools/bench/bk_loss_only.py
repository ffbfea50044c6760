"""Book-keeping with and without logits: one DP step on a tiny Llama with a large vocabulary.

The loss-only forward (``apply_model_patches`` + ``model(..., loss_only=True,
per_example_loss=True)``) never forms the ``(batch, seq, vocab)`` logits; the book-keeping
engine then takes ``lm_head``'s per-example norms and clipped sum from the chunked kernel's
``linear_cross_entropy_example_grads`` op, vocabulary tile by vocabulary tile. This script
compares, each configuration in a fresh process (so peak RSS is its own), median of ``--steps``
timed steps after ``--warmup``:

- ``nonprivate``: ``model(ids, labels).loss.backward()`` + SGD (logits materialised);
- ``nonprivate-lossonly``: the same through the patched loss-only forward;
- ``bk-logits``: book-keeping over ``causal_lm_losses(model(ids).logits)`` (unpatched model);
- ``bk-lossonly``: book-keeping over the loss-only forward (no logits anywhere);
- ``vmap-lossonly``: the vmap engine over the loss-only forward (per-example gradients);
- ``opacus-ghost``: Opacus ghost clipping on the unpatched model (its logits), as in
  ``dpsgd_step.py``, run by ``--opacus-python`` (skipped with a note where ``import opacus``
  fails there).

Each DP step is ``clipped_grad`` + ``DPOptimizer`` (noise once, SGD). Full fine-tuning of a Llama
built from a config (``--hidden`` 256, ``--layers`` 4, intermediate 2.6875 × hidden, one head
per 64 channels, vocabulary ``--vocab``, eager
attention), batch ``--batch`` × sequence ``--seq`` random tokens, 1 torch thread. ``--rounds N``
repeats every configuration N times interleaved; ratios to ``nonprivate`` are taken within each
round, then the median over rounds is reported.

    python tools/bench/bk_loss_only.py                       # markdown table
    python tools/bench/bk_loss_only.py --vocab 32000 --batch 16 --seq 64 --rounds 3
    python tools/bench/bk_loss_only.py --json out.json
    python tools/bench/bk_loss_only.py --unmap --rounds 3    # memory of live tensors only
    python tools/bench/bk_loss_only.py --opacus-python /tmp/bench-venv/bin/python  # + Opacus
    python tools/bench/bk_loss_only.py --device cuda --hidden 1024 --vocab 128256 --seq 1024

Results are recorded in docs/benchmarks.md ("Book-keeping engine", loss-only head).
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
from pathlib import Path
from typing import Any

from _dpsgd_methods import opacus_step
from _dpsgd_workload import Workload, llama

METHODS = (
    "nonprivate",
    "nonprivate-lossonly",
    "bk-logits",
    "bk-lossonly",
    "vmap-lossonly",
    "opacus-ghost",
)
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _build(args: argparse.Namespace, *, patched: bool) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    config = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": max(1, args.hidden // 64),
        "num_key_value_heads": max(1, args.hidden // 64),
        "intermediate_size": round(args.hidden * 2.6875),  # 688 for hidden 256
        "vocab_size": args.vocab,
    }
    model = llama(config, args.seq).to(args.device)
    model.train()
    if patched:
        from opake.patches import apply_model_patches

        apply_model_patches(model, chunked_linear_cross_entropy=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    return model, ids


def _step(method: str, args: argparse.Namespace) -> Callable[[], None]:
    import torch

    patched = method.endswith("lossonly")
    model, ids = _build(args, patched=patched)
    if method == "opacus-ghost":
        work = Workload({"vocab_size": args.vocab}, args.batch, args.seq, CLIP)
        return opacus_step(model, ids, True, work)[0]
    if method.startswith("nonprivate"):
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        extra = {"loss_only": True} if patched else {}

        def plain() -> None:
            sgd.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False, **extra).loss.backward()
            sgd.step()

        return plain

    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional

    fmodel, params = make_functional(model)

    def lossonly(p: Any, x: Any) -> Any:
        out = fmodel(
            p, input_ids=x, labels=x, loss_only=True, per_example_loss=True, use_cache=False
        )
        return out.loss

    def logits(p: Any, x: Any) -> Any:
        return causal_lm_losses(fmodel(p, input_ids=x, use_cache=False).logits, x)

    loss = BatchedLoss(lossonly if patched else logits, fmodel)
    engine = "vmap" if method.startswith("vmap") else "bookkeeping"
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=CLIP,
        batch_argnums=1,
        engine=engine,
        microbatch_size=args.microbatch if engine == "vmap" else None,
    )
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        params,
        noise_multiplier=SIGMA,
        expected_batch_size=float(args.batch),
        seed=0,
    )
    box = {"state": state}

    def private() -> None:
        grads, box["state"] = grad_fn(params, ids, state=box["state"])
        assert grad_fn.engine == engine, grad_fn.engine
        opt.accumulate(grads)
        opt.step()

    return private


def run_one(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up, time ``--steps`` steps; wall and CPU medians, peak RSS."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    get_memory_stats, reset_peak_memory = _memory_functions()

    dev = args.device
    cuda = dev.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    step = _step(method, args)
    for _ in range(args.warmup):
        step()
    sync()
    # steady state: memory in use before the timed steps, and its peak during them (on the CPU
    # the resident set: with --unmap, freed tensors leave it at once; on CUDA the allocator's)
    reset_peak_memory(dev)
    resident = get_memory_stats(dev).allocated_gb * 1024
    walls, cpus = [], []
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        sync()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    stats = get_memory_stats(dev)
    return {
        "method": method,
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "rss_mib": _peak_rss_mib(),
        "resident_mib": resident,
        "step_peak_mib": stats.peak_gb * 1024,
        "step_peak_exact": stats.peak_exact,
    }


def _memory_functions() -> tuple[Callable[[str], Any], Callable[[str], None]]:
    """``opake.profiling``'s memory functions; in an interpreter without Opake (the Opacus
    environment) the same CPU figures from ``/proc`` (resident set, peak reset by
    ``clear_refs``)."""
    try:
        from opake.profiling import get_memory_stats, reset_peak_memory
    except ImportError:
        pass
    else:
        return get_memory_stats, reset_peak_memory
    from types import SimpleNamespace

    def read(device: str) -> Any:
        fields = {}
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    fields[name] = int(value.split()[0]) / 1024**2  # kB -> GiB
        return SimpleNamespace(
            allocated_gb=fields["VmRSS"], peak_gb=fields["VmHWM"], peak_exact=True
        )

    def reset(device: str) -> None:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")

    return read, reset


def _worker(method: str, args: argparse.Namespace) -> dict[str, Any] | None:
    python = args.opacus_python if method.startswith("opacus") else sys.executable
    if method.startswith("opacus"):
        probe = subprocess.run([python, "-c", "import opacus"], capture_output=True, check=False)
        if probe.returncode != 0:
            print(f"  {method}: skipped (opacus not importable in {python})", file=sys.stderr)
            return None
    cmd = [
        python,
        __file__,
        "--worker",
        method,
        *("--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq)),
        *("--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--microbatch", str(args.microbatch), "--device", args.device),
        *("--hidden", str(args.hidden), "--layers", str(args.layers)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.unmap:  # large tensors are unmapped when freed: the resident set tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--microbatch", type=int, default=4, help="vmap engine microbatch (bounds its memory)"
    )
    parser.add_argument(
        "--unmap",
        action="store_true",
        help="run the workers with MALLOC_MMAP_THRESHOLD_=131072, so that the step peak and the "
        "resident set count live tensors only (every large allocation then page-faults anew: "
        "slower steps; take times from a run without it)",
    )
    parser.add_argument(
        "--opacus-python",
        default=sys.executable,
        help="interpreter with opacus installed, for opacus-ghost (default: this one)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _rounds(args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Every method in its own worker, ``--rounds`` times, interleaved."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        results = {}
        for method in args.methods:
            res = _worker(method, args)
            if res is None:
                continue
            results[method] = res
            print(
                f"  round {r + 1} {method}: wall {res['wall']:.3f} s, cpu {res['cpu']:.3f} s, "
                f"rss {res['rss_mib']:.0f} MiB, resident {res['resident_mib']:.0f} MiB, step "
                f"peak {res['step_peak_mib']:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
        rounds.append(results)
    return rounds


def _row(method: str, base: str, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds, and per-round ratios to *base* (then their median)."""

    def med(key: str) -> float:
        return float(statistics.median(rd[method][key] for rd in rounds))

    def ratio(key: str) -> float:
        return float(statistics.median(rd[method][key] / rd[base][key] for rd in rounds))

    return {
        "method": method,
        "wall": med("wall"),
        "cpu": med("cpu"),
        "rss_mib": med("rss_mib"),
        "wall_ratio": ratio("wall"),
        "cpu_ratio": ratio("cpu"),
        "rss_ratio": ratio("rss_mib"),
        "resident_mib": med("resident_mib"),
        "step_peak_mib": med("step_peak_mib"),
        "step_peak_ratio": ratio("step_peak_mib"),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(args.worker, args)))
        return 0
    import torch

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; device {args.device}; Llama h{args.hidden} "
        f"L{args.layers} vocab {args.vocab}, batch {args.batch} × "
        f"seq {args.seq}, full fine-tuning, 1 thread, median of {args.steps} steps, "
        f"{args.rounds} round(s)",
        flush=True,
    )
    rounds = _rounds(args)
    ran = [m for m in args.methods if all(m in rd for rd in rounds)]
    base = "nonprivate" if "nonprivate" in ran else ran[0]
    rows = [_row(method, base, rounds) for method in ran]
    print(
        f"\n| method | wall s/step | CPU s/step | × {base} (CPU) | step peak MiB | × {base} "
        f"(step peak) | resident before MiB | step peak − resident MiB | lifetime peak RSS MiB "
        f"| × {base} (lifetime) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| `{row['method']}` | {row['wall']:.3f} | {row['cpu']:.3f} | {row['cpu_ratio']:.2f} "
            f"| {row['step_peak_mib']:.0f} | {row['step_peak_ratio']:.2f} "
            f"| {row['resident_mib']:.0f} | {row['step_peak_mib'] - row['resident_mib']:.0f} "
            f"| {row['rss_mib']:.0f} | {row['rss_ratio']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
