"""The DP-step benchmark's workload: the tiny Llama, its batch and the settings every method shares.

A helper of ``dpsgd_step.py`` (not a benchmark: ``opake bench`` skips ``_*.py``), also used by
the benchmarks timed on the same model (``bk_loss_only.py``, ``trainer_overhead.py``,
``noise_generation.py``) and by the profilers of ``tools/profile``. It imports no Opake module:
the Opacus workers run it in an interpreter that may not have Opake.
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("full", "lora")
CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 4096,
}
BATCH, SEQ, LORA_R = 32, 64, 8
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3
# --check: a smaller Llama, and C set to the median per-example norm (half the examples clipped)
CHECK_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
}
CHECK_BATCH, CHECK_SEQ = 4, 16


@dataclass(frozen=True)
class Workload:
    """The model config, the batch shape and the clipping norm of one configuration."""

    config: dict[str, int]
    batch: int
    seq: int
    clip: float
    model: str | None = None  # a Hugging Face model directory (pretrained) instead of config


BENCH = Workload(CONFIG, BATCH, SEQ, CLIP)


def peak_rss_mib() -> float:
    """This process's peak resident set, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llama(config: dict[str, int], seq: int) -> Any:
    """A ``LlamaForCausalLM`` built from *config* (eager attention, positions up to *seq*)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options: dict[str, Any] = {
        **config,
        "max_position_embeddings": seq,
        "attn_implementation": "eager",
    }
    return LlamaForCausalLM(LlamaConfig(**options))


def has_weights(directory: str) -> bool:
    """Whether a model directory holds weights (else :func:`build` makes random ones)."""
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    return any((Path(directory) / name).is_file() for name in names)


def build(mode: str, work: Workload = BENCH) -> tuple[Any, Any]:
    """The model of *work* (``mode="lora"``: with LoRA adapters on q/v), in training mode, and
    a batch of random token ids of its vocabulary (seeded: every process builds the same)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model: Any
    if work.model is not None and not has_weights(work.model):  # a shape: random weights
        config = AutoConfig.from_pretrained(work.model, attn_implementation="eager")
        # transformers leaves from_config untyped
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    elif work.model is not None:  # pretrained weights, fp32, the same attention as the config
        model = AutoModelForCausalLM.from_pretrained(
            work.model, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        model = llama(work.config, work.seq)
    vocab = int(model.config.vocab_size)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (work.batch, work.seq), generator=gen)
    return model, ids


def workload(args: argparse.Namespace) -> Workload:
    """The timed configuration: the tiny Llama or ``--model``, ``--batch`` × ``--seq``."""
    batch, seq = args.batch or BATCH, args.seq or SEQ
    if args.model is None:
        return Workload(CONFIG, batch, seq, CLIP)
    return Workload({}, batch, seq, CLIP, model=args.model)
