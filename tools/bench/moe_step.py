"""One DP-SGD gradient step vs a non-private one on tiny mixture-of-experts models.

Models (built from configs, eager attention, no download), batch 32 × sequence 64 of random
tokens, full fine-tuning:

- ``mixtral``: Mixtral-style, 8 experts, top-2 (hidden 64, expert width 128, 2 layers,
  vocabulary 1024);
- ``qwen3_moe``: Qwen3-MoE-style, 16 experts, top-4, renormalised (hidden 64, expert width 64,
  2 layers, vocabulary 1024).

Methods (each the work up to the gradient that noise is added to; noise and the optimizer step
are the same small cost for every method and left out):

- ``nonprivate``: the stock model, ``model(input_ids, labels=...).loss.backward()``;
- ``bookkeeping``: ``apply_model_patches`` + ``clipped_grad(BatchedLoss(loss_only=True,
  per_example_loss=True), engine="bookkeeping")`` — one batched forward/backward, the router
  book-kept from its tapped logits, the fused experts by the ``fused_experts`` rule
  (``opake.models.bookkeeping``: sparse experts, ghost norms over each example's tokens routed
  to each expert, the clipped sum as one matmul per expert);
- ``vmap``: the same patched model, ``clipped_grad(engine="vmap", microbatch_size=--microbatch)``
  on the one-example loss-only forward (dense experts per example);
- ``opacus``: Opacus ``GradSampleModule`` hooks on the stock model, if ``import opacus`` works;
  otherwise, or if Opacus refuses the model, skipped with the reason.

Rounds interleave the methods (``--rounds``); per round and method, one warm-up step, then the
median of ``--steps`` timed steps as wall time and process CPU time (the latter robust to other
processes on a shared machine); ratios to ``nonprivate`` are taken within each round, then the
median over rounds is reported.

    python tools/bench/moe_step.py                       # both models, markdown table
    python tools/bench/moe_step.py --models mixtral --rounds 3 --json out.json
    python tools/bench/moe_step.py --methods nonprivate bookkeeping --threads 1 --train experts

``--train experts`` (``no-experts``) trains only the fused experts (everything but them) in
every method, which isolates the experts rule's share of the overhead. Where the book-keeping
step's time goes inside the engine is a developer profiler, not shipped:
``tools/profile/moe_breakdown.py``.

``--processes N`` repeats the whole run in N fresh processes and reports, per row, the median
and range of their ratios (one process's memory layout can shift its ratio by more than the
rounds inside it vary):

    python tools/bench/moe_step.py --methods nonprivate bookkeeping --rounds 5 --processes 7

Results are recorded in docs/benchmarks.md ("Mixture of experts").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

BATCH, SEQ, VOCAB = 32, 64, 1024
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": {**BASE, "intermediate_size": 128, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {
        **BASE,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
    },
}
METHODS = ("nonprivate", "bookkeeping", "vmap", "opacus")
#: ``--train`` choices: which parameters are trained (the rest frozen, for every method)
TRAIN: dict[str, Callable[[str], bool]] = {
    "all": lambda name: True,
    "experts": lambda name: ".experts." in name,
    "no-experts": lambda name: ".experts." not in name,
}
_TRAIN = ["all"]


def _model(name: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **MODELS[name])
    build: Any = AutoModelForCausalLM.from_config  # unannotated in transformers
    model = build(config, attn_implementation="eager").train()
    for param_name, param in model.named_parameters():
        param.requires_grad_(TRAIN[_TRAIN[0]](param_name))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.ones_like(ids)


def _nonprivate(name: str, _: argparse.Namespace) -> Callable[[], None]:
    model = _model(name)
    ids, mask = _batch()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    return step


def _private(name: str, args: argparse.Namespace, method: str) -> Callable[[], None]:
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional
    from opake.patches import apply_model_patches

    model = _model(name)
    apply_model_patches(model)
    fmodel, params, frozen = make_functional(model, partition_trainable=True)
    ids, mask = _batch()

    def losses(p: Any, f: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = fmodel(
            (p, f),
            input_ids=ids,
            attention_mask=mask,
            labels=ids,
            loss_only=True,
            per_example_loss=True,
        )
        loss: torch.Tensor = out.loss
        return loss

    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=1.0,
        batch_argnums=(2, 3),
        microbatch_size=args.microbatch if method == "vmap" else BATCH,
        engine=method,
    )
    holder = {"state": state}

    def step() -> None:
        _, holder["state"] = grad_fn(params, frozen, ids, mask, state=holder["state"])
        if grad_fn.engine != method:
            raise RuntimeError(f"asked for {method}, ran {grad_fn.engine}: {grad_fn.engine_reason}")

    return step


def _opacus(name: str, _: argparse.Namespace) -> Callable[[], None]:
    from opacus import GradSampleModule  # ImportError: skipped

    model = GradSampleModule(_model(name))
    ids, mask = _batch()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        norms = torch.stack(
            [p.grad_sample.reshape(BATCH, -1).norm(dim=1) for p in model.parameters()], dim=1
        ).norm(dim=1)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            p.summed = torch.einsum("i,i...->...", factor, p.grad_sample)

    return step


def build_step(name: str, method: str, args: argparse.Namespace) -> Callable[[], None]:
    """The step of *method* on the model *name* (``step()`` runs one)."""
    if method == "nonprivate":
        return _nonprivate(name, args)
    if method == "opacus":
        return _opacus(name, args)
    return _private(name, args, method)


def time_step(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """One warm-up step, then the medians of *steps* steps: (wall s, process CPU s)."""
    step()  # warm-up (and book-keeping's first-call check)
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def _across_processes(args: argparse.Namespace) -> None:
    """Run this benchmark (without ``--processes``) in ``args.processes`` fresh processes, one
    after another, and print each one's ratios and, per row, their median and range (``--json``:
    every process's rows): a process's memory layout moves its step times by more than a
    round-to-round spread shows."""
    import subprocess
    import sys
    import tempfile

    argv = _without(sys.argv[1:], ("--processes", "--json"))
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.processes):
            out = f"{tmp}/run{k}.json"
            subprocess.run([sys.executable, __file__, *argv, "--json", out], check=True)
            with open(out) as f:
                runs.append(json.load(f)["rows"])
    print(f"\n{args.processes} processes, median [min–max] of their ratios to non-private:\n")
    print("| model | method | wall ÷ non-private | CPU ÷ non-private | CPU ratio per process |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(runs[0]):
        wall = [run[i]["wall_ratio"] for run in runs]
        cpu = [run[i]["cpu_ratio"] for run in runs]
        each = " / ".join(f"{v:.2f}" for v in cpu)
        print(
            f"| {row['model']} | {row['method']} | {statistics.median(wall):.2f} "
            f"[{min(wall):.2f}–{max(wall):.2f}] | {statistics.median(cpu):.2f} "
            f"[{min(cpu):.2f}–{max(cpu):.2f}] | {each} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"processes": runs}, f)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without each of ``options`` and its value (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in options:
            skip = True
        elif not token.startswith(tuple(f"{o}=" for o in options)):
            out.append(token)
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (``tools/profile/moe_breakdown.py`` takes the same)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatch", type=int, default=8, help="vmap engine microbatch")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--train", default="all", choices=list(TRAIN), help="trained parameters (rest frozen)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="repeat the whole run in this many fresh processes; report the median of their ratios",
    )
    return parser


def configure(args: argparse.Namespace) -> None:
    """Apply ``--train`` and ``--threads`` to the models built from now on."""
    _TRAIN[0] = args.train
    if args.threads:
        torch.set_num_threads(args.threads)


def build_steps(
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, str], Callable[[], None]], dict[tuple[str, str], str]]:
    """Every (model, method) step, and why each one that cannot run this model was skipped."""
    steps: dict[tuple[str, str], Callable[[], None]] = {}
    skipped: dict[tuple[str, str], str] = {}
    for name in args.models:
        for method in args.methods:
            try:
                step = build_step(name, method, args)
                if method == "opacus":
                    step()  # Opacus fails on layers it cannot hook on first use
                steps[name, method] = step
            except Exception as err:  # a method that cannot run this model is reported
                first = str(err).splitlines()[0][:160] if str(err) else ""
                skipped[name, method] = f"{type(err).__name__}: {first}"
    return steps, skipped


def _report(
    results: dict[tuple[str, str], list[tuple[float, float]]],
    skipped: dict[tuple[str, str], str],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    rows = []
    print(
        f"batch {BATCH} × {SEQ}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {args.rounds} rounds × {args.steps} steps"
    )
    print("\n| model | method | wall s | CPU s | wall ÷ non-private | CPU ÷ non-private |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        base = results.get((name, "nonprivate"))
        for method in args.methods:
            if (name, method) in skipped:
                print(f"| {name} | {method} | — | — | skipped: {skipped[name, method]} | |")
                continue
            runs = results[name, method]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            if base:
                rw = statistics.median(r[0] / b[0] for r, b in zip(runs, base, strict=True))
                rc = statistics.median(r[1] / b[1] for r, b in zip(runs, base, strict=True))
            else:
                rw = rc = float("nan")
            rows.append({"model": name, "method": method, "wall": wall, "cpu": cpu,
                         "wall_ratio": rw, "cpu_ratio": rc})  # fmt: skip
            print(f"| {name} | {method} | {wall:.3f} | {cpu:.3f} | {rw:.2f} | {rc:.2f} |")
    return rows


def main() -> None:
    args = parser().parse_args()
    if args.processes > 1:
        _across_processes(args)
        return
    configure(args)
    steps, skipped = build_steps(args)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            results[key].append(time_step(step, args.steps))
    rows = _report(results, skipped, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "skipped": {f"{k[0]}/{k[1]}": v for k, v in skipped.items()}}, f
            )


if __name__ == "__main__":
    main()
