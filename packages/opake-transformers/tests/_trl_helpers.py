"""A word-level tokenizer with a chat template, tiny post-training data sets and DP TRL configs
shared by the test_trl_* tests (offline: nothing is downloaded)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

N = 24
PER_DEVICE, ACCUM = 3, 2
SIGMA, CLIP, LR, SEED, BETA = 1.1, 0.5, 0.05, 3, 0.5
WORDS = [f"w{i}" for i in range(H.VOCAB - 6)]

#: roles as words, the assistant's turn inside {% generation %} (assistant_only_loss)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + ' </s> ' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + ' </s> ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def tokenizer() -> Any:
    """Words ``w0 .. w57`` and the roles, split on whitespace; ``<pad>`` = 0, ``</s>`` = 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<unk>", "</s>", "user:", "assistant:", "system:", *WORDS]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _words(gen: torch.Generator, low: int, high: int) -> str:
    count = int(torch.randint(low, high + 1, (1,), generator=gen))
    picks = torch.randint(0, len(WORDS), (count,), generator=gen).tolist()
    return " ".join(WORDS[i] for i in picks)


def messages(n: int = N, seed: int = 0) -> Any:
    """Conversations: a user turn of 2..4 words, an assistant turn of 1..5."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    rows = [
        {
            "messages": [
                {"role": "user", "content": _words(gen, 2, 4)},
                {"role": "assistant", "content": _words(gen, 1, 5)},
            ]
        }
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def prompt_completion(n: int = N, seed: int = 1) -> Any:
    """Plain prompt/completion records (the completion starts with a space)."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    rows = [{"prompt": _words(gen, 2, 4), "completion": " " + _words(gen, 1, 5)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def preferences(n: int = N, seed: int = 2) -> Any:
    """Plain prompt/chosen/rejected records of different lengths."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    rows = [
        {
            "prompt": _words(gen, 2, 4),
            "chosen": " " + _words(gen, 1, 4),
            "rejected": " " + _words(gen, 1, 4),
        }
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def settings(out: Any, **options: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "output_dir": str(out),
        "noise_multiplier": SIGMA,
        "per_sample_max_grad_norm": CLIP,
        "per_device_train_batch_size": PER_DEVICE,
        "gradient_accumulation_steps": ACCUM,
        "max_steps": 1,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "optim": "sgd",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "reproducible": True,
        "seed": SEED,
        "disable_tqdm": True,
        "accountant": "rdp",
        "microbatch_size": 16,  # no memory probe: tests stay fast
        "max_length": 32,
    }
    values.update(options)
    return values


def sft_config(out: Any, **options: Any) -> Any:
    from opake.transformers.trl import DPSFTConfig

    return DPSFTConfig(**settings(out, **options))


def dpo_config(out: Any, **options: Any) -> Any:
    from opake.transformers.trl import DPDPOConfig

    options.setdefault("beta", BETA)
    return DPDPOConfig(**settings(out, **options))


def first_batch(n: int = N) -> list[list[int]]:
    """The physical batches of the first logical step (Poisson, seeded as the trainers are)."""
    from opake.dpsgd.sampling import PoissonSampler
    from opake.transformers._collate import split

    q = PER_DEVICE * ACCUM / n
    return split(PoissonSampler(n, q, seed=SEED).global_batch(0).tolist(), ACCUM)


def model(seed: int = 0) -> Any:
    return H.tiny_causal_lm(seed=seed)


def params(m: Any) -> dict[str, torch.Tensor]:
    return H.params(m)
