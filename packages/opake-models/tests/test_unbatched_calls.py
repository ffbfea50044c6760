"""Unbatched per-example calls through ``clipped_grad``, next to the book-keeping engine.

Every family's forward and ``vmap(grad)`` is covered by the conformance check
``unbatched_calls`` (``test_families.py``). Here, the code a user ports —
``loss_fn(params, x, y)`` calling the model on the example as ``vmap`` hands it over, without
``x[None]`` — runs through ``clipped_grad`` on a PEFT LoRA model: the clipped sum is the one of
the ``[None]`` loss bit for bit, and equals the book-keeping engine's, whose ``BatchedLoss``
calls the same patched model with a batch (the unbatched-call wrapper leaves those calls alone).
The 4-D float masks arrive per example as ``(1, T, T)``.
"""

from __future__ import annotations

import pytest
import torch

from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.models.testing import tiny_model
from opake.patches import apply_model_patches
from opake.patches.hf import additive_attention_mask

peft = pytest.importorskip("peft")

#: GPT-2 (the issue's "too many indices" report) and a classifier (a 0-d label per example)
CASES = {"gpt2": ("c_attn",), "bert": ("query", "value")}


def _setup(family):
    model = peft.get_peft_model(
        tiny_model(family), peft.LoraConfig(r=2, target_modules=list(CASES[family]))
    )
    apply_model_patches(model, kernels="chunked")
    causal = family != "bert"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(model.config.vocab_size), (3, 8), generator=gen)
    pad = torch.ones_like(ids)
    pad[1, 6:] = 0
    pad[2, :2] = 0
    mask = additive_attention_mask(pad, dtype=torch.float32, causal=causal)  # (3, 1, 8, 8)
    labels = ids.masked_fill(pad == 0, -100) if causal else torch.tensor([0, 1, 2])
    return model, causal, (ids, mask, labels)


@pytest.mark.parametrize("family", list(CASES))
def test_clipped_grad_with_an_unbatched_loss(family):
    model, causal, batch = _setup(family)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    extra = {"loss_only": True} if causal else {}

    def unbatched(t, ids, mask, labels):  # what vmap hands over: no batch dimension
        out = fmodel((t, frozen), input_ids=ids, attention_mask=mask, labels=labels, **extra)
        assert out.loss.shape == ()
        return out.loss

    def with_none(t, ids, mask, labels):
        return unbatched(t, ids[None], mask[None], labels[None])

    def batched(t, ids, mask, labels):  # the book-keeping engine's batched loss: [B] losses
        out = fmodel((t, frozen), input_ids=ids, attention_mask=mask, labels=labels,
                     loss_only=True, per_example_loss=True)  # fmt: skip
        return out.loss

    results = {}
    for name, loss_fn, engine in [
        ("unbatched", unbatched, "vmap"),
        ("none", with_none, "vmap"),
        ("bookkeeping", BatchedLoss(batched, fmodel), "bookkeeping"),
    ]:
        if name == "bookkeeping" and not causal:
            continue  # a classifier has no loss-only head to give per-example losses
        grad_fn, state = clipped_grad(
            loss_fn, clipping_norm=1e-3, batch_argnums=(1, 2, 3), microbatch_size=2, engine=engine
        )
        results[name], _ = grad_fn(trainable, *batch, state=state)
    for k in trainable:
        assert torch.equal(results["unbatched"][k], results["none"][k]), k
        if "bookkeeping" in results:
            torch.testing.assert_close(
                results["unbatched"][k], results["bookkeeping"][k], rtol=1e-5, atol=1e-9
            )
