"""One timed run of ``post_training_step.py`` in its own process (a helper module).

``python _post_training_worker.py OBJECTIVE MODE METHOD --model-dir DIR ...`` trains
``--warmup + --steps`` optimizer steps of one trainer and prints one JSON line: the median wall
and CPU seconds per step (from one step's end to the next, the warm-up steps left out), this
process's peak RSS and its RSS when training started. It imports only the standard library,
torch, transformers, peft, trl and ``datasets`` at module level of its functions, so it runs in
an environment with Opacus and ``dptrainer`` instead of Opake.

Methods: ``trl`` (TRL's own ``SFTTrainer`` / ``DPOTrainer``, non-private), ``opake``
(``opake.transformers.trl.DPSFTTrainer`` / ``DPDPOTrainer``), ``dptrainer-hooks`` and
``dptrainer-ghost`` (TRL's trainer with the ``dptrainer`` package's Opacus ``DPTrainer`` as its
base, per-sample gradients by hooks or ghost clipping). Every DP method: σ = 1, C = 1.

Batches: ``trl`` and ``dptrainer-*`` take exactly ``--batch`` records per step (``dptrainer``
with ``poisson_sampling=False``); ``opake`` always samples Poisson batches (expected size
``--batch``, physical batches of at most ``--batch`` records through ``microbatch_size``), so
its time per step is the timed steps' total over their records, times ``--batch`` (see
:meth:`_Clock.per_step`). Every row is cut to exactly ``--seq`` tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

OBJECTIVES = ("sft", "dpo")
MODES = ("lora", "full")
METHODS = ("trl", "opake", "dptrainer-hooks", "dptrainer-ghost")
RECORDS = 256
BATCH_INDICES_KEY = "opake_batch_indices"  # the Opake trainers' record indices in a batch
TARGETS = ["q_proj", "v_proj"]


def _rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def records(objective: str, words: int) -> list[dict[str, str]]:
    """``RECORDS`` records cut from Python's documentation, each longer than the token budget
    (every row is truncated to exactly ``max_length`` tokens, so every step does the same work).
    """
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[name].split()) for name in sorted(topics)).split(" ")
    out = []
    for i in range(RECORDS):
        at = (i * 997) % (len(text) - 3 * words)
        head = " ".join(text[at : at + 24])
        rest = " ".join(text[at + 24 : at + 24 + words])
        if objective == "sft":
            out.append({"prompt": head, "completion": " " + rest})
        else:
            other = (at + len(text) // 2) % (len(text) - 2 * words)
            rejected = " ".join(text[other : other + words])
            out.append({"prompt": head, "chosen": " " + rest, "rejected": " " + rejected})
    return out


class _Clock:
    """Wall and CPU seconds from one optimizer step's end to the next (a Trainer callback)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self.records: list[int] = []  # per step, where the trainer samples (Opake)
        self.pending = 0
        self.rss_at_start = 0.0
        self._last = (0.0, 0.0)

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Timing(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                clock.rss_at_start = _rss_mib()
                clock._last = (time.perf_counter(), time.process_time())
                return control

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                now = (time.perf_counter(), time.process_time())
                clock.steps.append((now[0] - clock._last[0], now[1] - clock._last[1]))
                clock.records.append(clock.pending)
                clock.pending = 0
                clock._last = now
                return control

        return Timing()

    def count(self, trainer: Any) -> None:
        """Count the records of each physical batch the trainer's Poisson sampler drew."""
        step = trainer.training_step

        def counted(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            self.pending += len(inputs[BATCH_INDICES_KEY])
            return step(model, inputs, *a, **kw)

        trainer.training_step = counted

    def per_step(self, warmup: int, batch: int, sampled: bool) -> tuple[float, float, int]:
        """Seconds per step of *batch* records (wall, CPU) and the steps timed. Fixed batches:
        the median over the timed steps. Poisson batches (*sampled*): all timed steps' seconds
        over all their records, times *batch* — the throughput a run sees, splits into several
        physical batches included (a per-step median would weigh small draws' fixed costs
        as if every record paid them)."""
        kept = list(zip(self.steps, self.records, strict=True))[warmup:]
        if not kept:
            return math.nan, math.nan, 0
        if not sampled:
            return (
                statistics.median(w for (w, _), _ in kept),
                statistics.median(c for (_, c), _ in kept),
                len(kept),
            )
        records = sum(n for _, n in kept)
        if not records:
            return math.nan, math.nan, 0
        wall = sum(w for (w, _), _ in kept) * batch / records
        return wall, sum(c for (_, c), _ in kept) * batch / records, len(kept)


def _config(objective: str, method: str, out: str, args: argparse.Namespace) -> Any:
    common: dict[str, Any] = {
        "output_dir": out,
        "max_length": args.seq,
        "per_device_train_batch_size": args.batch,
        "max_steps": args.warmup + args.steps,
        "learning_rate": 1e-4,
        "logging_steps": 10_000,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": 0,
    }
    if method == "opake":
        from opake.transformers.trl import DPDPOConfig, DPSFTConfig

        dp = {
            "noise_multiplier": 1.0,
            "per_sample_max_grad_norm": 1.0,
            "microbatch_size": args.batch,  # physical batches of at most --batch records
        }
        return (DPSFTConfig if objective == "sft" else DPDPOConfig)(**common, **dp)
    from trl.trainer.dpo_config import DPOConfig
    from trl.trainer.sft_config import SFTConfig

    return (SFTConfig if objective == "sft" else DPOConfig)(**common)


def _trainer_class(objective: str, method: str) -> Any:
    if method == "opake":
        from opake.transformers.trl import DPDPOTrainer, DPSFTTrainer

        return DPSFTTrainer if objective == "sft" else DPDPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.sft_trainer import SFTTrainer

    kind: Any = SFTTrainer if objective == "sft" else DPOTrainer
    if method.startswith("dptrainer"):  # the peer package, in its own environment
        dptrainer = importlib.import_module("dptrainer")
        privacy = dptrainer.PrivacyArguments(
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=method.removeprefix("dptrainer-"),
            epsilon_log_mode="none",
        )
        # privatize_trainer rebases TRL's class hierarchy on dptrainer's Opacus DPTrainer (this
        # process only); the subclass carries the privacy arguments
        kind = type(f"DP{kind.__name__}", (kind,), {})
        dptrainer.privatize_trainer(kind, default_privacy_args=privacy)
    return kind


def _model(mode: str, args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    if mode == "full":
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=TARGETS,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def run(objective: str, mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one run; its timing and memory figures."""
    import datasets
    import torch
    from transformers import AutoTokenizer, PrinterCallback

    torch.set_num_threads(args.threads) if args.threads else None
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    data = datasets.Dataset.from_list(records(objective, words=2 * args.seq))
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer_class(objective, method)(
            model=_model(mode, args),
            args=_config(objective, method, out, args),
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[clock.callback()],
        )
        trainer.remove_callback(PrinterCallback)
        if method == "opake":
            clock.count(trainer)
        trainer.train()
    wall, cpu, timed = clock.per_step(args.warmup, args.batch, sampled=method == "opake")
    if not timed:
        raise SystemExit(f"no timed step with a record: {len(clock.steps)} steps ran")
    return {
        "objective": objective,
        "mode": mode,
        "method": method,
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": timed,
        "records": clock.records[args.warmup :] if method == "opake" else None,
        "peak_rss_mib": _peak_rss_mib(),
        "rss_at_start_mib": clock.rss_at_start,
        "threads": torch.get_num_threads(),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("objective", choices=OBJECTIVES)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    result = run(args.objective, args.mode, args.method, args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
