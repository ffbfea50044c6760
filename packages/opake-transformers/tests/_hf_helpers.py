"""Tiny models, data and a DPTrainer factory shared by the opake-transformers tests (and the
two-rank worker)."""

from __future__ import annotations

from typing import Any

import torch

N = 40
PER_DEVICE, ACCUM = 4, 2
SIGMA, CLIP, LR, SEED = 1.1, 0.5, 0.05, 3
VOCAB = 64


def tiny_causal_lm(seed: int = 0) -> Any:
    from opake.core.testing import tiny_llama

    model = tiny_llama(
        hidden_size=16, num_hidden_layers=1, vocab_size=VOCAB, intermediate_size=32, seed=seed
    )
    return model.train()


def tiny_classifier(seed: int = 0) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation="eager",
    )
    return BertForSequenceClassification(config).train()


def token_data(n: int = N, *, labels: bool = False, seed: int = 0) -> list[dict[str, Any]]:
    """Variable-length token sequences (3..10 tokens), optionally with a class label."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 11, (1,), generator=gen))
        row: dict[str, Any] = {
            "input_ids": torch.randint(1, VOCAB, (length,), generator=gen).tolist()
        }
        if labels:
            row["labels"] = int(torch.randint(0, 3, (1,), generator=gen))
        rows.append(row)
    return rows


def dp_args(out: Any, **options: Any) -> Any:
    from opake.transformers import DPTrainingArguments

    settings: dict[str, Any] = {
        "output_dir": str(out),
        "noise_multiplier": SIGMA,
        "per_sample_max_grad_norm": CLIP,
        "per_device_train_batch_size": PER_DEVICE,
        "gradient_accumulation_steps": ACCUM,
        "max_steps": 3,
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
    }
    settings.update(options)
    return DPTrainingArguments(**settings)


def params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def count_compiled_graphs(monkeypatch: Any) -> list[Any]:
    """Make ``torch.compile`` trace with a Dynamo backend that records each graph it captures
    and runs it as captured (like ``backend="eager"``: no Inductor, seconds instead of a minute
    on a CPU); the list the graphs go to. Call ``torch._dynamo.reset()`` around the test."""
    import functools

    graphs: list[Any] = []

    def backend(gm: Any, example_inputs: Any, **options: Any) -> Any:  # options: Inductor's
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    return graphs
