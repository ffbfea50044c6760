"""The DP step compiled (``DPTraining(compile=True)``) vs eager vs non-private, compiled or not.

Every configuration runs in a fresh Python process (its compile time, Inductor's cache aside, and
its peak RSS are its own) on the DP-step benchmark's tiny Llama (``_dpsgd_workload.py``: hidden
256, 4 layers, vocabulary 4096, batch 32 × 64 random tokens) or ``--model smollm2``, full
fine-tuning and LoRA (r = 8 on q/v), SGD:

- ``nonprivate``: ``model(input_ids, labels).loss.backward()``, ``optimizer.step()``, eager.
- ``nonprivate-compiled``: the same through ``torch.compile(model)`` (Inductor compiles the
  forward and, through AOTAutograd, the backward): the baseline of the compiled DP step.
- ``opake``: ``DPTraining`` with a one-example loss (``engine="auto"``, which is the vmap
  engine for such a loss), ``microbatch_size`` rows per chunk: today's eager DP step.
- ``opake-bk``: ``DPTraining`` with a ``BatchedLoss`` (``engine="auto"`` then picks the
  book-keeping engine): the fastest eager DP step for these models.
- ``opake-compiled``: ``DPTraining(..., compile=True)`` with the one-example loss (vmap engine,
  one graph per chunk shape of ``microbatch_size`` rows).
- ``opake-bk-compiled``: ``DPTraining(..., compile=True)`` with the ``BatchedLoss``: for full
  fine-tuning the book-keeping engine with its batched forward and backward compiled; for LoRA
  (a small differentiated part) the vmap engine compiled whole, as ``opake-compiled``.

Per configuration: the first step (which compiles, for the compiled ones), ``--warmup`` more
steps, then the median of ``--steps`` timed steps as wall time and as process CPU time (robust
to other processes on the machine); ``--rounds N`` repeats everything interleaved and reports
medians over rounds, ratios taken within each round. Threads: torch's default unless
``--threads``.

    python tools/bench/compile_step.py                          # tiny Llama, full and LoRA
    python tools/bench/compile_step.py --modes lora --rounds 3
    python tools/bench/compile_step.py --model smollm2 --batch 8 --seq 128 --modes lora
    python tools/bench/compile_step.py --device cuda --json out.json   # on a GPU
    python tools/bench/compile_step.py --paired --modes full --steps 15 \
        --methods nonprivate nonprivate-compiled opake-bk opake-bk-compiled   # paired ratios
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _dpsgd_workload import BENCH, CLIP, LR, MODES, SIGMA, Workload, build, peak_rss_mib

METHODS = (
    "nonprivate",
    "nonprivate-compiled",
    "opake",
    "opake-bk",
    "opake-compiled",
    "opake-bk-compiled",
)
SCRIPT = Path(__file__).resolve()


def _workload(args: argparse.Namespace) -> Workload:
    if args.model is None and not (args.batch or args.seq):
        return BENCH
    from _dpsgd_workload import workload

    if args.model is not None:
        from _pretrained import resolve_model

        args.model = resolve_model(args.model)
    return workload(args)


def _nonprivate(model: Any, ids: Any, compiled: bool) -> Any:
    import torch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    return step


def _private(model: Any, ids: Any, method: str, args: argparse.Namespace, work: Workload) -> Any:
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.sampling import padding_mask
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def one(p: Any, frozen: Any, x: Any) -> Any:  # one example [SEQ]
        return fmodel((p, frozen), input_ids=x[None], labels=x[None], use_cache=False).loss

    def batched(p: Any, frozen: Any, x: Any) -> Any:  # [B] per-example losses
        return causal_lm_losses(fmodel((p, frozen), input_ids=x, use_cache=False).logits, x)

    loss = BatchedLoss(batched, fmodel) if method.startswith("opake-bk") else one
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    # fixed-shape sampling with B_max = the batch: every step computes ``work.batch`` rows, as
    # the non-private step does (padding slots masked); half as many drawn on average, so a
    # truncation practically never happens
    pool = torch.randint(0, int(ids.max()) + 1, (100 * work.batch, ids.shape[1]))
    pool = pool.to(ids.device)
    training = DPTraining(
        loss,
        opt,
        trainable,
        args=(frozen,),
        dataset_size=pool.shape[0],
        expected_batch_size=work.batch / 2,
        sampler="fixed",
        max_batch_size=work.batch,
        noise_multiplier=SIGMA,
        delta=1e-5,
        clipping_norm=CLIP,
        microbatch_size=args.microbatch_size,
        compile=method.endswith("compiled"),
        seed=0,  # reproducible noise: the timing, not the privacy, is measured here
        accountant="rdp",
    )

    drawn = training.batches()

    def step() -> None:
        indices = next(drawn)
        rows = torch.as_tensor(indices, device=pool.device)
        training.step(pool[rows], example_mask=padding_mask(indices).to(pool.device))

    return step


def worker(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time one configuration in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = _workload(args)
    model, ids = build(mode, work)
    device = torch.device(args.device)
    model, ids = model.to(device), ids.to(device)
    if method.startswith("nonprivate"):
        step = _nonprivate(model, ids, compiled=method.endswith("compiled"))
    else:
        step = _private(model, ids, method, args, work)

    def timed() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu

    first = timed()[0]
    for _ in range(args.warmup):
        timed()
    samples = [timed() for _ in range(args.steps)]
    return {
        "mode": mode,
        "method": method,
        "first_s": first,
        "wall_ms": 1e3 * statistics.median(s[0] for s in samples),
        "cpu_ms": 1e3 * statistics.median(s[1] for s in samples),
        "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }


def paired(mode: str, args: argparse.Namespace) -> None:
    """``--paired``: every method of ``mode`` built in this one process, their steps
    interleaved (A, B, C, A, B, C, ...): the ratios are taken step by step, so they do not
    carry the drift between processes a shared machine shows. First steps (compilations) and
    peak memory are not separated here: use the default mode for those."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = _workload(args)
    steps: dict[str, Any] = {}
    for method in args.methods:
        model, ids = build(mode, work)
        if method.startswith("nonprivate"):
            steps[method] = _nonprivate(model, ids, compiled=method.endswith("compiled"))
        else:
            steps[method] = _private(model, ids, method, args, work)
        for _ in range(1 + args.warmup):
            steps[method]()
    times: dict[str, list[float]] = {method: [] for method in args.methods}
    for _ in range(args.steps):
        for method, step in steps.items():
            start = time.perf_counter()
            step()
            times[method].append(time.perf_counter() - start)
    base = args.methods[0]
    print(f"| mode | method | step ms (median) | × {base} (median of paired ratios) |")
    print("|---|---|---|---|")
    for method, samples in times.items():
        ratios = [t / b for t, b in zip(samples, times[base], strict=True)]
        print(
            f"| {mode} | {method} | {1e3 * statistics.median(samples):.0f} "
            f"| {statistics.median(ratios):.3f}× |"
        )


def _run(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any] | str:
    cmd = [sys.executable, str(SCRIPT), "--worker", mode, method, "--device", args.device]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--microbatch-size", str(args.microbatch_size), "--threads", str(args.threads)]
    for flag, value in (("--model", args.model), ("--batch", args.batch), ("--seq", args.seq)):
        if value:
            cmd += [flag, str(value)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{mode}/{method}: failed ({tail[:300]})"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _table(rounds: list[dict[tuple[str, str], dict[str, Any]]], args: argparse.Namespace) -> None:
    print(
        "| mode | method | first step (s) | step ms (wall) | step ms (CPU) | × non-private "
        "| × non-private compiled | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for method in args.methods:
            runs = [r[(mode, method)] for r in rounds if (mode, method) in r]
            if not runs:
                continue

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                return float(statistics.median(float(run[key]) for run in runs))

            def ratio(base: str, mode: str = mode, method: str = method) -> str:
                values = [
                    r[(mode, method)]["wall_ms"] / r[(mode, base)]["wall_ms"]
                    for r in rounds
                    if (mode, method) in r and (mode, base) in r
                ]
                return f"{statistics.median(values):.2f}×" if values else "—"

            print(
                f"| {mode} | {method} | {med('first_s'):.1f} | {med('wall_ms'):.0f} "
                f"| {med('cpu_ms'):.0f} | {ratio('nonprivate')} "
                f"| {ratio('nonprivate-compiled')} | {med('peak_rss_mib'):.0f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median; ≥ 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--microbatch-size", type=int, default=8, help="rows per DP chunk")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="smollm2, a .gguf file or a model directory")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="all methods in one process, steps interleaved: paired ratios to the first method",
    )
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (a median)")
    if args.worker:
        mode, method = args.worker
        print(json.dumps(worker(mode, method, args)))
        return 0
    if args.paired:
        machine = f"{platform.machine()} {os.cpu_count()} CPUs"
        print(f"# compile_step --paired: {machine}, {args.steps} interleaved steps")
        for mode in args.modes:
            paired(mode, args)
        return 0
    print(
        f"# compile_step: {platform.machine()} {os.cpu_count()} CPUs, device {args.device}, "
        f"threads {args.threads or 'default'}, microbatch {args.microbatch_size}, "
        f"{args.rounds} round(s), model {args.model or 'tiny Llama'}"
    )
    rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
    failures: list[str] = []
    for _ in range(args.rounds):
        results: dict[tuple[str, str], dict[str, Any]] = {}
        for mode in args.modes:
            for method in args.methods:
                out = _run(mode, method, args)
                if isinstance(out, str):
                    failures.append(out)
                    print(out, file=sys.stderr)
                else:
                    results[(mode, method)] = out
        rounds.append(results)
    _table(rounds, args)
    if args.json:
        args.json.write_text(json.dumps([list(r.values()) for r in rounds], indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
