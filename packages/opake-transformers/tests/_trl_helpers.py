"""A word-level tokenizer with a chat template, tiny post-training data sets, DP TRL configs and
trainers shared by the TRL tests (offline: nothing is downloaded), and their hand-written
``DPTraining`` step and resume check. ``H`` is :mod:`_hf_helpers`."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
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

#: ``pytestmark`` of the test_trl_* modules: TRL and transformers warn about their own choices
MARKS = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(autouse=True)
def quiet_datasets() -> Iterator[None]:
    """No ``datasets`` progress bars while the trainers map the records (a module takes it as
    ``_quiet_datasets = T.quiet_datasets``)."""
    import datasets

    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


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


def sft_trainer(
    out: Any, *, model: Any = None, data: Any = None, peft_config: Any = None, **options: Any
) -> Any:
    """A ``DPSFTTrainer`` of :func:`model` on :func:`messages` (or ``model``, ``data``), its
    config ``sft_config(out, **options)``, ``assistant_only_loss=True`` unless said."""
    from opake.transformers.trl import DPSFTTrainer

    options.setdefault("assistant_only_loss", True)
    args = sft_config(out, **options)
    return _trainer(DPSFTTrainer, args, model, messages() if data is None else data, peft_config)


def dpo_trainer(
    out: Any, *, model: Any = None, data: Any = None, peft_config: Any = None, **options: Any
) -> Any:
    """A ``DPDPOTrainer`` of :func:`model` on :func:`preferences` (or ``model``, ``data``), its
    config ``dpo_config(out, **options)``."""
    from opake.transformers.trl import DPDPOTrainer

    args = dpo_config(out, **options)
    return _trainer(DPDPOTrainer, args, model, preferences() if data is None else data, peft_config)


def _trainer(cls: Any, args: Any, m: Any, data: Any, peft_config: Any) -> Any:
    return cls(
        model=model() if m is None else m,
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
        peft_config=peft_config,
    )


def hand_written_training(loss: Any, m: Any, trainable: Any, frozen: Any, **options: Any) -> Any:
    """The ``DPTraining`` the trainers' configs compose, built by hand for model ``m``: SGD at
    ``LR``, the expected batch ``PER_DEVICE·ACCUM`` of ``N``, ``SIGMA``, ``CLIP``, δ = 1/N²."""
    from opake.dpsgd.training import DPTraining

    return DPTraining(
        loss,
        torch.optim.SGD(m.parameters(), lr=LR),
        trainable,
        args=(frozen,),
        dataset_size=N,
        expected_batch_size=PER_DEVICE * ACCUM,
        noise_multiplier=SIGMA,
        delta=1.0 / N**2,
        clipping_norm=CLIP,
        accountant="rdp",
        seed=SEED,
        **options,
    )


def check_resume_and_epsilon(trainer: Callable[..., Any], out: Path) -> None:
    """``trainer(out, **options)`` resumed from its step-2 checkpoint ends exactly where the
    uninterrupted 3-step run does, and every logged ε is the accountant's."""
    from opake import accounting

    full = trainer(out / "full", max_steps=3)
    full.train()
    first = trainer(out / "run", max_steps=3, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = out / "run" / "checkpoint-2"
    assert (checkpoint / "opake_dp_state.pt").is_file()
    resumed = trainer(out / "run", max_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.dp_training.steps == 3
    want = params(full.model)
    for name, value in params(resumed.model).items():
        assert torch.equal(value, want[name]), name

    q = PER_DEVICE * ACCUM / N
    logged = [h for h in full.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    for h in logged:
        expected = accounting.epsilon(
            sample_rate=q,
            noise_multiplier=SIGMA,
            steps=h["step"],
            delta=1.0 / N**2,
            accountant="rdp",
        )
        assert h["epsilon"] == pytest.approx(expected, rel=1e-12)
        assert (h["delta"], h["noise_multiplier"], h["sample_rate"]) == (1 / N**2, SIGMA, q)
    assert resumed.state.log_history[-1]["epsilon"] == full.state.log_history[-1]["epsilon"]
