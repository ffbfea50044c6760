"""DP post-training of a real model: SFT and DPO on SmolLM2-135M-Instruct, DP vs non-private.

A demonstration of ``opake.transformers.trl`` on the one real pretrained LLM available offline
(SmolLM2-135M-Instruct, fp32, ``--model smollm2``; see ``_pretrained.py``), with LoRA adapters
(rank ``--rank`` on the attention's query and value projections) on the CPU. The data is Python's
own documentation (``pydoc_data.topics``, shipped with Python; see ``_post_training_data.py``):
every prose sentence is one record, whose prompt asks the model to continue the sentence's first
half ("In Python's documentation of <topic>: <first half>") and whose answer is the rest (SFT);
for DPO the true rest is ``chosen`` and the rest of a sentence of another topic ``rejected``. A
tenth of the records is held out (seeded).

For each objective and each privacy setting the same number of steps is trained with the same
batch size, learning rate (Adam, constant) and LoRA initialisation, from the same model:

* ``eps8``, ``eps3``: ``DPSFTTrainer`` / ``DPDPOTrainer`` with ``target_epsilon`` 8 or 3 at
  ``--delta`` (σ calibrated for the planned steps; Poisson sampling of expected batch
  ``--batch`` records; each record's gradient clipped to ``--clip``; secure noise unless
  ``--reproducible``);
* ``nonprivate``: TRL's own ``SFTTrainer`` / ``DPOTrainer`` (shuffled batches of ``--batch``,
  TRL's defaults otherwise: global gradient-norm clipping at 1).

Held-out metrics (plain forward passes without gradient): for SFT, the mean over records of each
record's mean NLL over its completion tokens; for DPO, the preference accuracy (pairs whose
implicit reward margin β[(log π(c) − log ref(c)) − (log π(r) − log ref(r))] is > 0, the reference
being the starting model) and the mean margin — both 0 before training by definition — and the
log-probability preference accuracy (log π(c) > log π(r), summed over completion tokens), before
and after. The time per step is the median wall time from step end to step end (the first step
left out when there are more).

    python tools/bench/post_training_demo.py --quick     # tiny, end to end (a few minutes)
    python tools/bench/post_training_demo.py             # the full run (about 23 min, 2 cores)
    python tools/bench/post_training_demo.py --objectives sft --settings eps8 nonprivate

The full run: 8 steps of 32 records (DP: expected, Poisson) per run, max_length 64, 96 held-out
records scored; on 2 otherwise idle cores (OMP_NUM_THREADS=2) a step takes about 9-10 s for SFT
and 40 s for DPO. Record its tables in docs/benchmarks.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _post_training_data as data
from _pretrained import resolve_model

SETTINGS: dict[str, float | None] = {"eps8": 8.0, "eps3": 3.0, "nonprivate": None}
OBJECTIVES = ("sft", "dpo")
TARGETS = ["q_proj", "v_proj"]


@dataclass
class Result:
    """One trained run and its held-out metrics."""

    objective: str
    setting: str
    epsilon: float | None
    delta: float | None
    sigma: float | None
    steps: int
    step_s: float
    step_cpu_s: float
    train_s: float
    step_times: list[tuple[float, float]]
    truncated: int | None
    metrics: dict[str, float]


@dataclass
class Context:
    """What every run shares: the arguments, the model directory, tokenizer and data."""

    args: argparse.Namespace
    model_dir: str
    tokenizer: Any
    train: list[data.Record]
    held_out: list[data.Record]


def load_model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


class _Clock:
    """Wall and CPU seconds of each optimizer step, from step end to step end (a Trainer
    callback); the CPU time is this process's, robust to other work on the machine."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self._last = (time.perf_counter(), time.process_time())

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Timing(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                clock._last = (time.perf_counter(), time.process_time())
                return control

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                now = (time.perf_counter(), time.process_time())
                clock.steps.append((now[0] - clock._last[0], now[1] - clock._last[1]))
                clock._last = now
                return control

        return Timing()

    def per_step(self, which: int) -> float:
        """The median wall (0) or CPU (1) seconds per step, the first left out if not alone."""
        kept = [step[which] for step in self.steps]
        kept = kept[1:] if len(kept) > 1 else kept
        return statistics.median(kept) if kept else float("nan")


def _config(objective: str, setting: str, out: str, args: argparse.Namespace) -> Any:
    """The trainer's config: the same schedule for every setting, DP fields for DP ones."""
    common: dict[str, Any] = {
        "output_dir": out,
        "max_length": args.max_length,
        "per_device_train_batch_size": args.batch,
        "max_steps": args.steps,
        "learning_rate": args.lr if objective == "sft" else args.dpo_lr,
        "lr_scheduler_type": "constant",
        "logging_steps": args.steps,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": args.seed,
    }
    if objective == "dpo":
        common["beta"] = args.beta
    epsilon = SETTINGS[setting]
    if epsilon is None:
        from trl.trainer.dpo_config import DPOConfig
        from trl.trainer.sft_config import SFTConfig

        return (SFTConfig if objective == "sft" else DPOConfig)(**common)
    from opake.transformers.trl import DPDPOConfig, DPSFTConfig

    dp = {
        "target_epsilon": epsilon,
        "target_delta": args.delta,
        "per_sample_max_grad_norm": args.clip,
        "reproducible": args.reproducible,
    }
    return (DPSFTConfig if objective == "sft" else DPDPOConfig)(**common, **dp)


def _trainer(objective: str, setting: str, config: Any, ctx: Context, clock: _Clock) -> Any:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import PrinterCallback

    rows = [(data.sft_row if objective == "sft" else data.dpo_row)(r) for r in ctx.train]
    private = SETTINGS[setting] is not None
    if objective == "sft":
        from trl.trainer.sft_trainer import SFTTrainer

        from opake.transformers.trl import DPSFTTrainer

        kind: Any = DPSFTTrainer if private else SFTTrainer
    else:
        from trl.trainer.dpo_trainer import DPOTrainer

        from opake.transformers.trl import DPDPOTrainer

        kind = DPDPOTrainer if private else DPOTrainer
    torch.manual_seed(ctx.args.seed)  # the same LoRA initialisation for every setting
    lora = LoraConfig(
        r=ctx.args.rank,
        lora_alpha=2 * ctx.args.rank,
        lora_dropout=0.0,
        target_modules=TARGETS,
        task_type="CAUSAL_LM",
    )
    trainer = kind(
        model=load_model(ctx.model_dir),
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=ctx.tokenizer,
        peft_config=lora,
        callbacks=[clock.callback()],
    )
    trainer.remove_callback(PrinterCallback)  # the logs stay in trainer.state.log_history
    return trainer


def train(objective: str, setting: str, ctx: Context) -> tuple[Any, Result]:
    """Train one run; returns the trained model and its figures (metrics filled in later)."""
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        config = _config(objective, setting, out, ctx.args)
        trainer = _trainer(objective, setting, config, ctx, clock)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    last = logged[-1] if logged else {}
    counts = getattr(trainer, "truncation", {}).get("train")
    result = Result(
        objective=objective,
        setting=setting,
        epsilon=last.get("epsilon"),
        delta=last.get("delta"),
        sigma=last.get("noise_multiplier"),
        steps=int(trainer.state.global_step),
        step_s=clock.per_step(0),
        step_cpu_s=clock.per_step(1),
        train_s=elapsed,
        step_times=clock.steps,
        truncated=None if counts is None else int(counts.truncated),
        metrics={},
    )
    return trainer.model, result


# -- held-out metrics ----------------------------------------------------------------------------


def _rows(ctx: Context, tails: str) -> list[tuple[list[int], int, bool]]:
    """The held-out records tokenised with their true rest (``tail``) or ``rejected`` one."""
    return [
        data.encode(ctx.tokenizer, r, getattr(r, tails), ctx.args.max_length) for r in ctx.held_out
    ]


def _logps(model: Any, rows: list[tuple[list[int], int, bool]], ctx: Context) -> list[float]:
    return [s for s, _ in data.completion_log_probs(model, rows, ctx.tokenizer.pad_token_id)]


def _log_prob_accuracy(chosen: list[float], rejected: list[float]) -> float:
    wins = sum(c > r for c, r in zip(chosen, rejected, strict=True))
    return wins / max(1, len(chosen))


def evaluate(objective: str, setting: str, ctx: Context, base: dict[str, Any]) -> Result:
    """Train one run and measure it on the held-out records."""
    model, result = train(objective, setting, ctx)
    if objective == "sft":
        loss = data.sft_loss(model, base["chosen_rows"], ctx.tokenizer.pad_token_id)
        result.metrics = {"nll": loss}
    else:
        chosen = _logps(model, base["chosen_rows"], ctx)
        rejected = _logps(model, base["rejected_rows"], ctx)
        ref = (base["ref_chosen"], base["ref_rejected"])
        pref = data.preference(chosen, rejected, ref, ctx.args.beta)
        result.metrics = {
            "reward_accuracy": pref.accuracy,
            "margin": pref.margin,
            "log_prob_accuracy": _log_prob_accuracy(chosen, rejected),
        }
    figures = ", ".join(f"{k} {v:.4g}" for k, v in result.metrics.items())
    print(
        f"done: {objective} {setting}: ε {result.epsilon}, {result.steps} steps in "
        f"{result.train_s:.0f} s; {figures}",
        file=sys.stderr,
        flush=True,
    )
    return result


def baseline(objective: str, ctx: Context) -> dict[str, Any]:
    """The starting model's held-out figures (and the rows and reference log-probabilities)."""
    model = load_model(ctx.model_dir)
    base: dict[str, Any] = {"chosen_rows": _rows(ctx, "tail")}
    if objective == "sft":
        base["nll"] = data.sft_loss(model, base["chosen_rows"], ctx.tokenizer.pad_token_id)
    else:
        base["rejected_rows"] = _rows(ctx, "rejected")
        base["ref_chosen"] = _logps(model, base["chosen_rows"], ctx)
        base["ref_rejected"] = _logps(model, base["rejected_rows"], ctx)
        base["log_prob_accuracy"] = _log_prob_accuracy(base["ref_chosen"], base["ref_rejected"])
    return base


# -- tables --------------------------------------------------------------------------------------


def _privacy(r: Result) -> tuple[str, str]:
    if r.epsilon is None:
        return "∞ (non-private)", "—"
    return f"{r.epsilon:.2f} (δ = {r.delta:.0e})", f"{r.sigma:.3f}"


def table(objective: str, results: list[Result], base: dict[str, Any]) -> list[str]:
    """The markdown table of one objective."""
    if objective == "sft":
        head = "| setting | ε spent | σ | steps | s/step wall (CPU) | held-out NLL before | after |"
    else:
        head = (
            "| setting | ε spent | σ | steps | s/step wall (CPU) | log-prob pref. acc. before "
            "| after | reward acc. after (0 before) | mean margin after (0 before) |"
        )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        eps, sigma = _privacy(r)
        cells = [r.setting, eps, sigma, str(r.steps), f"{r.step_s:.1f} ({r.step_cpu_s:.1f})"]
        if objective == "sft":
            cells += [f"{base['nll']:.4f}", f"{r.metrics['nll']:.4f}"]
        else:
            m = r.metrics
            cells += [
                f"{100 * base['log_prob_accuracy']:.1f} %",
                f"{100 * m['log_prob_accuracy']:.1f} %",
                f"{100 * m['reward_accuracy']:.1f} %",
                f"{m['margin']:+.4f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    import torch

    return (
        f"machine: {_cpu_model()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"Python {platform.python_version()}"
    )


# -- command line --------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2", help="smollm2, a GGUF file or a model directory")
    add("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    add("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    add("--steps", type=int, default=8, help="optimizer steps of every run")
    add("--batch", type=int, default=32, help="records per step (DP: expected, Poisson)")
    add("--lr", type=float, default=2e-3, help="SFT learning rate (Adam, constant)")
    add("--dpo-lr", type=float, default=1e-3, help="DPO learning rate (Adam, constant)")
    add("--beta", type=float, default=0.1, help="DPO's β")
    add("--rank", type=int, default=8, help="LoRA rank (q_proj, v_proj)")
    add("--clip", type=float, default=1.0, help="C: per-record clipping norm (DP)")
    add("--delta", type=float, default=1e-5, help="δ of the DP runs")
    add("--max-length", type=int, default=64, help="tokens per sequence (longer ones cut)")
    add("--train-records", type=int, default=0, help="subsample the training records (0: all)")
    add("--eval-records", type=int, default=96, help="held-out records scored")
    add("--seed", type=int, default=0)
    add("--reproducible", action="store_true", help="seeded DP sampling and noise (not secure)")
    add("--quick", action="store_true", help="tiny: 2 steps, 8 records, max-length 48")
    add("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.max_length = 2, 4, 48
        args.train_records, args.eval_records = 8, 8
    return args


def context(args: argparse.Namespace) -> Context:
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    split = data.split_records(args.seed)
    train = split.train
    if args.train_records:
        train = random.Random(args.seed).sample(train, min(args.train_records, len(train)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # held-out records with a completion token left after the cut (chosen and rejected alike)
    held = [
        r
        for r in split.held_out
        if all(
            data.encode(tokenizer, r, tail, args.max_length)[1] < args.max_length
            for tail in (r.tail, r.rejected)
        )
    ]
    held = held[: args.eval_records] if args.eval_records else held
    print(
        f"data: {split.sentences} sentences of pydoc_data.topics; {len(train)} training records "
        f"(of {len(split.train)}), {len(held)} held-out scored (of {len(split.held_out)})",
        file=sys.stderr,
    )
    return Context(args, model_dir, tokenizer, train, held)


def _quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    warnings.filterwarnings("ignore", module=r"(transformers|trl|peft|torch)(\.|$)")
    for name in ("transformers", "trl", "peft", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _header(objective: str, ctx: Context, cut: tuple[int, int], held: tuple[int, int]) -> str:
    a = ctx.args
    dpo = objective == "dpo"
    return (
        f"### {objective.upper()}: {len(ctx.train)} training records, {len(ctx.held_out)} held "
        f"out; LoRA r={a.rank} on {'/'.join(TARGETS)}; batch {a.batch}, "
        f"lr {a.dpo_lr if dpo else a.lr:g} (Adam, constant)"
        + (f", β {a.beta:g}" if dpo else "")
        + f"\nmax_length {a.max_length}: training records truncated {cut[0]}, dropped {cut[1]} "
        f"(held-out: {held[0]} truncated); C = {a.clip:g}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _quiet()
    ctx = context(args)
    report: dict[str, Any] = {"command": shlex.join([sys.executable, *sys.argv]), "runs": []}
    out = [machine(), f"command: {report['command']}", ""]
    for objective in args.objectives:
        dpo = objective == "dpo"
        cut = data.truncated(ctx.tokenizer, ctx.train, args.max_length, dpo)
        held_cut = data.truncated(ctx.tokenizer, ctx.held_out, args.max_length, dpo)
        base = baseline(objective, ctx)
        results = [evaluate(objective, s, ctx, base) for s in args.settings]
        out += [_header(objective, ctx, cut, held_cut), "", *table(objective, results, base), ""]
        scalars = {k: v for k, v in base.items() if isinstance(v, float)}
        report["runs"] += [asdict(r) | {"before": scalars} for r in results]
        report[f"{objective}_truncated"] = {"train": cut, "held_out": held_cut}
    print("\n".join(out))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
