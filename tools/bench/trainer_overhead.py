"""What the Hugging Face Trainer integration costs: DPTrainer vs the DP step alone vs Trainer.

On the DP-step benchmark model of ``tools/bench/dpsgd_step.py`` (a Llama from a config: hidden
256, 4 layers, 4 heads, intermediate 688, vocabulary 4096, eager attention; random token
sequences of 64 tokens; SGD), one process, in interleaved rounds:

- ``dptrainer``: ``opake.transformers.DPTrainer`` (Poisson batches of expected size ``--batch``,
  one physical batch per step, σ = 1, C = 1, seeded), ``Trainer.train()``;
- ``composition``: the same DP step driven by a plain loop — ``DPTraining.batches()``, the same
  ``DPDataCollator``, ``DPTraining.step`` — with the same seeds, so both see the *same* Poisson
  batches and do the same work;
- ``nonprivate``: ``transformers.Trainer`` on fixed batches of ``--batch`` (no clipping, no noise).

Each run takes ``--steps`` optimizer steps; a step's time is from the end of the previous step
to the end of this one (data loading, collation, the step, the Trainer's bookkeeping), as wall
time and as this process's CPU time (robust to other processes on the machine); the order
of the methods rotates from round to round. The first
``--warmup`` steps of every run are dropped (first-call checks, engine choice). Reported: the
median over all kept steps of all rounds, and the median over rounds of the per-round ratio
``dptrainer / composition`` (the Trainer's own overhead) and ``/ nonprivate``. Logging is off
during the timed steps (``logging_steps`` beyond the run); ε is computed once per logging step
when it is on.

    python tools/bench/trainer_overhead.py                 # 3 rounds × 6 steps, markdown table
    python tools/bench/trainer_overhead.py --rounds 5 --steps 8 --json out.json

Results are recorded in docs/benchmarks.md ("Hugging Face Trainer overhead").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from _dpsgd_workload import BENCH, CLIP, LR, SIGMA, llama

METHODS = ("dptrainer", "composition", "nonprivate")
N = 2048
SEED = 0


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return llama(BENCH.config, BENCH.seq).train()


def _data() -> list[dict[str, list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BENCH.config["vocab_size"], (N, BENCH.seq), generator=gen)
    return [{"input_ids": row.tolist()} for row in ids]


class _Clock:
    """Per-step (wall, CPU) seconds from step end to step end."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self._last = (time.perf_counter(), time.process_time())

    def start(self) -> None:
        self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.steps.append((now[0] - self._last[0], now[1] - self._last[1]))
        self._last = now


def _callback(clock: _Clock) -> Any:
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            clock.start()
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            clock.tick()
            return control

    return Timing()


def _common(out: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "output_dir": out,
        "per_device_train_batch_size": args.batch,
        "max_steps": args.steps,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "optim": "sgd",
        "logging_steps": args.steps + 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": SEED,
    }


def run_dptrainer(data: list[Any], args: argparse.Namespace) -> list[tuple[float, float]]:
    from opake.transformers import DPTrainer, DPTrainingArguments

    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        targs = DPTrainingArguments(
            **_common(out, args),
            noise_multiplier=SIGMA,
            per_sample_max_grad_norm=CLIP,
            reproducible=True,
            accountant="rdp",
            engine=args.engine,
        )
        trainer = DPTrainer(model=_model(), args=targs, train_dataset=data)
        trainer.add_callback(_callback(clock))
        trainer.train()
    return clock.steps


def run_composition(data: list[Any], args: argparse.Namespace) -> list[tuple[float, float]]:
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional
    from opake.transformers import DPDataCollator

    model = _model()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def losses(trainable: Any, frozen: Any, batch: dict[str, Any]) -> Any:
        """Each example's mean token loss, as DPTrainer computes it for a causal LM."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = fmodel((trainable, frozen), **inputs, use_cache=False)
        return causal_lm_losses(out.logits, batch["labels"])

    loss = BatchedLoss(losses, fmodel)
    training = DPTraining(
        loss,
        torch.optim.SGD(model.parameters(), lr=LR),
        trainable,
        args=(frozen,),
        module=model,
        dataset_size=len(data),
        expected_batch_size=float(args.batch),
        noise_multiplier=SIGMA,
        delta=1.0 / len(data) ** 2,
        clipping_norm=CLIP,
        engine=args.engine,
        randomness="error",  # the benchmark Llama has no dropout (DPTrainer chooses the same)
        accountant="rdp",
        seed=SEED,
    )
    collate = DPDataCollator(pad_token_id=0, causal=True)
    clock = _Clock()
    clock.start()
    for _, indices in zip(range(args.steps), training.batches(), strict=False):
        training.step(collate([data[i] for i in indices]))
        clock.tick()
    return clock.steps


def run_nonprivate(data: list[Any], args: argparse.Namespace) -> list[tuple[float, float]]:
    from transformers import Trainer, TrainingArguments

    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(**_common(out, args))

        def collate(rows: list[dict[str, list[int]]]) -> dict[str, Any]:
            import torch

            ids = torch.tensor([r["input_ids"] for r in rows])
            return {"input_ids": ids, "labels": ids.clone()}

        trainer = Trainer(model=_model(), args=targs, train_dataset=data, data_collator=collate)
        trainer.add_callback(_callback(clock))
        trainer.train()
    return clock.steps


RUNNERS = {"dptrainer": run_dptrainer, "composition": run_composition, "nonprivate": run_nonprivate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=BENCH.batch)
    parser.add_argument("--engine", default="auto", choices=("auto", "vmap", "bookkeeping"))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    import torch

    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = _data()
    kept: dict[str, list[tuple[float, float]]] = {m: [] for m in args.methods}
    per_round: dict[str, list[float]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        # rotate the order every round: no method always runs right after another's teardown
        shift = r % len(args.methods)
        for method in args.methods[shift:] + args.methods[:shift]:
            steps = RUNNERS[method](data, args)[args.warmup :]
            kept[method] += steps
            per_round[method].append(statistics.median(cpu for _, cpu in steps))
            print(
                f"round {r + 1}/{args.rounds} {method}: median CPU "
                f"{per_round[method][-1]:.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    rows = {}
    for method in args.methods:
        rows[method] = {
            "wall_s": statistics.median(w for w, _ in kept[method]),
            "cpu_s": statistics.median(c for _, c in kept[method]),
        }
        for base in ("composition", "nonprivate"):
            if base in per_round and base != method:
                ratios = [a / b for a, b in zip(per_round[method], per_round[base], strict=True)]
                rows[method][f"cpu_vs_{base}"] = statistics.median(ratios)
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch} × "
        f"{BENCH.seq} tokens, {args.rounds} rounds × {args.steps} steps ({args.warmup} dropped)\n"
    )
    print("| method | wall s/step | CPU s/step | CPU vs composition | CPU vs non-private |")
    print("|---|---|---|---|---|")
    for method, row in rows.items():
        vs_c = row.get("cpu_vs_composition")
        vs_n = row.get("cpu_vs_nonprivate")
        print(
            f"| {method} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} | "
            f"{'—' if vs_c is None else f'{vs_c:.3f}×'} | "
            f"{'—' if vs_n is None else f'{vs_n:.2f}×'} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
