"""clipped_grad on tiny Hugging Face models (full and LoRA) against the per-example loop."""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

pytest.importorskip("transformers")

# sdpa on CPU has no vmap batching rule: torch warns and falls back to a loop (still exact)
SDPA_FALLBACK = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
)


def _check_against_loop(model, input_ids, *, microbatch_size=None):
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss_fn = testing.causal_lm_loss(fmodel)
    args = (trainable, frozen, input_ids, input_ids)
    per_example, _ = testing.per_example_grads_loop(loss_fn, args, batch_argnums=(2, 3))
    norms = sorted(
        math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in per_example
    )
    clip = 0.5 * (norms[1] + norms[2])  # two of the four examples get clipped
    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=clip,
        batch_argnums=(2, 3),
        microbatch_size=microbatch_size,
        return_aux=True,
    )
    (grads, aux), _ = grad_fn(*args, state=state)
    # LoRA (few trainable numbers next to a frozen model) takes the expanded-forward path
    lora = any("lora_" in name for name in trainable)
    assert grad_fn._prefer_expanded(args, differentiable=False) is lora
    assert grad_fn._expand_disabled is None
    expected = testing.reference_clipped_sum(per_example, clipping_norm=clip)
    testing.assert_grads_close(grads, expected, rtol=1e-5)
    assert float(aux.clipping_rate) == 0.5
    assert int(grads.batch_size) == input_ids.shape[0]
    return trainable, frozen


def test_llama_full(tiny_llama, token_batch):
    trainable, frozen = _check_against_loop(tiny_llama, token_batch)
    assert not frozen
    assert len(trainable) == len(list(tiny_llama.parameters()))


def test_llama_lora(tiny_llama, token_batch):
    pytest.importorskip("peft")
    model = testing.with_lora(tiny_llama, r=4)
    trainable, frozen = _check_against_loop(model, token_batch, microbatch_size=3)
    assert all("lora_" in name for name in trainable)
    assert len(trainable) == 8  # 2 layers × (q, v) × (A, B)
    assert frozen


def test_gpt2_full_tied_embeddings(tiny_gpt2, token_batch):
    trainable, _ = _check_against_loop(tiny_gpt2, token_batch, microbatch_size=2)
    assert "lm_head.weight" not in trainable  # tied to transformer.wte.weight


@SDPA_FALLBACK
def test_gpt2_sdpa(token_batch):
    model = testing.tiny_gpt2(n_embd=32, n_layer=2, vocab_size=128, attn_implementation="sdpa")
    _check_against_loop(model, token_batch)


@SDPA_FALLBACK
def test_llama_sdpa_lora(token_batch):
    pytest.importorskip("peft")
    base = testing.tiny_llama(hidden_size=32, vocab_size=128, attn_implementation="sdpa")
    _check_against_loop(
        testing.with_lora(base, r=2, target_modules=("q_proj", "o_proj")), token_batch
    )


def test_padding_via_labels_is_per_example(tiny_llama, token_batch):
    """-100 labels on one example change only that example's loss (no batch-global mean)."""
    fmodel, params = make_functional(tiny_llama)

    def loss_fn(params, input_ids, labels):
        return fmodel(params, input_ids=input_ids[None], labels=labels[None], use_cache=False).loss

    labels = token_batch.clone()
    labels[0, 4:] = -100
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1e-2, batch_argnums=(1, 2), return_aux=True
    )
    (grads, aux), _ = grad_fn(params, token_batch, labels, state=state)
    expected = testing.reference_clipped_grad(
        loss_fn, (params, token_batch, labels), clipping_norm=1e-2, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)
    (_, full_aux), _ = grad_fn(params, token_batch, token_batch, state=state)
    torch.testing.assert_close(aux.loss_values[1:], full_aux.loss_values[1:])
    assert not torch.isclose(aux.loss_values[0], full_aux.loss_values[0])


@pytest.mark.parametrize("engine", ["vmap", "auto"])
def test_batchnorm_in_train_mode_is_refused_with_a_typed_error_and_its_statistics_kept(
    engine: str,
) -> None:
    from opake.core.errors import OperationError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    fmodel, params = make_functional(net)

    def loss(p, x, y):
        return (fmodel(p, x[None])[0, 0] - y) ** 2

    before = net[1].running_mean.clone()
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), engine=engine)
    with pytest.raises(OperationError, match="BatchNorm's running statistics"):
        grad_fn(params, torch.randn(4, 3), torch.randn(4), state=state)
    assert torch.equal(net[1].running_mean, before)
    net.eval()  # what the message says: in eval mode the same loss runs
    grads, _ = grad_fn(params, torch.randn(4, 3), torch.randn(4), state=state)
    assert set(grads) == set(params)
