"""Unbatched per-example calls: a 1-D ``input_ids`` (one example, as under ``vmap``) runs as a
batch of one and returns unbatched outputs; batched calls pass through untouched.

Every opake-models family is covered by the conformance check ``unbatched_calls``
(opake-models' ``test_families.py``); here a toy family on a tiny Llama exercises the wrapper
itself: values and gradients, outputs, checkpointing and ``save_on_cpu``, errors, removal.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, grad_and_value, vmap

from opake.core import plugins
from opake.core.errors import ConfigurationError, InputTypeError
from opake.core.plugins import KernelBackend, ModelFamily, hookimpl
from opake.patches import (
    FamilyResult,
    HFCompat,
    LossOnlyHead,
    apply_model_patches,
    remove_model_patches,
)
from opake.patches.hf import UNBATCHED_RANKS, install_unbatched_calls, is_unbatched_call

pytest.importorskip("transformers")


def ref_lce(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", **_):
    """The obvious linear cross-entropy (full logits)."""
    logits = F.linear(hidden, weight, bias).float()
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).reshape(labels.shape)
    if reduction == "per_example":
        counts = (labels != ignore_index).reshape(labels.shape[0], -1).sum(-1).clamp_min(1)
        return nll.reshape(labels.shape[0], -1).sum(-1) / counts
    return nll.sum() / (labels != ignore_index).sum().clamp_min(1)


def toy_apply(model, options):
    return FamilyResult(hf=HFCompat("causal", LossOnlyHead()))


class _Plugin:
    @hookimpl
    def opake_model_families(self):
        return [ModelFamily("toyllama", ("llama",), apply=toy_apply)]

    @hookimpl
    def opake_kernel_backends(self):
        return [KernelBackend("torch", {"linear_cross_entropy": ref_lce}, ("cpu", "cuda"))]


@pytest.fixture
def toy(fresh_plugins):
    plugins.register_plugin(_Plugin(), "toy")


@pytest.fixture
def batch():
    """Three examples: unpadded, left-padded, right-padded; labels ignore the padding."""
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, 4:] = 0
    return ids, mask, torch.where(mask.bool(), ids, -100)


def _params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def _loss(model, params, x, am, y, *, unbatched, loss_only):
    if not unbatched:
        x, am, y = x[None], am[None], y[None]
    kwargs = {"attention_mask": am, "labels": y, **({"loss_only": True} if loss_only else {})}
    return functional_call(model, params, (x,), kwargs).loss


def _vmapped(model, batch, *, unbatched, loss_only=True):
    fn = functools.partial(_loss, model, unbatched=unbatched, loss_only=loss_only)
    with torch.no_grad():
        return vmap(grad_and_value(fn), in_dims=(None, 0, 0, 0))(_params(model), *batch)


def _assert_equal(got, expected):
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


# -- values and gradients --------------------------------------------------------------------------


@pytest.mark.parametrize("loss_only", [True, False], ids=["loss_only", "logits"])
def test_vmap_grad_unbatched_equals_none_and_the_loop(toy, tiny_llama, batch, loss_only):
    model, plain = tiny_llama(), tiny_llama()
    apply_model_patches(model)
    grads, losses = _vmapped(model, batch, unbatched=True, loss_only=loss_only)
    ref_grads, ref_losses = _vmapped(model, batch, unbatched=False, loss_only=loss_only)
    _assert_equal(grads, ref_grads)  # the same operations on the same tensors: bit for bit
    assert torch.equal(losses, ref_losses)
    assert losses.shape == (3,)
    loop = []
    for x, am, y in zip(*batch, strict=True):  # plain autograd on the unpatched model
        plain.zero_grad()
        plain(x[None], attention_mask=am[None], labels=y[None]).loss.backward()
        loop.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    for k in grads:
        torch.testing.assert_close(
            grads[k], torch.stack([g[k] for g in loop]), rtol=1e-4, atol=1e-6
        )


def test_checkpointing_and_save_on_cpu(toy, tiny_llama, batch, hf_checkpointing):
    model = tiny_llama()
    apply_model_patches(model)
    expected, _ = _vmapped(model, batch, unbatched=False)  # without checkpointing
    remove_model_patches(model)
    hf_checkpointing(model)
    apply_model_patches(model)
    with torch.autograd.graph.save_on_cpu():
        grads, _ = _vmapped(model, batch, unbatched=True)
        ref_grads, _ = _vmapped(model, batch, unbatched=False)
    _assert_equal(grads, ref_grads)
    for k in expected:
        torch.testing.assert_close(grads[k], expected[k], rtol=1e-5, atol=1e-7)


def test_inputs_embeds_and_positional_arguments(toy, tiny_llama, batch):
    model = tiny_llama()
    apply_model_patches(model)
    ids, mask, labels = batch
    embeds = model.get_input_embeddings()(ids).detach()

    def by_embeds(p, e, am, y):
        return functional_call(model, p, (), {"inputs_embeds": e, "attention_mask": am,
                                              "labels": y}).loss  # fmt: skip

    def by_embeds_none(p, e, am, y):
        return by_embeds(p, e[None], am[None], y[None])

    with torch.no_grad():
        got = vmap(grad(by_embeds), in_dims=(None, 0, 0, 0))(_params(model), embeds, mask, labels)
        ref = vmap(grad(by_embeds_none), in_dims=(None, 0, 0, 0))(
            _params(model), embeds, mask, labels
        )
        _assert_equal(got, ref)
        # input_ids and attention_mask positionally (the model's own parameter order)
        out = model(ids[1], mask[1], labels=labels[1])
        ref_out = model(ids[1][None], mask[1][None], labels=labels[1][None])
    assert out.logits.shape == (6, 64)
    assert torch.equal(out.logits, ref_out.logits[0])
    assert torch.equal(out.loss, ref_out.loss)


# -- outputs -----------------------------------------------------------------------------------


def test_forward_outputs_are_unbatched(toy, tiny_llama, batch):
    model = tiny_llama()
    apply_model_patches(model)
    ids, mask, labels = (t[2] for t in batch)
    extra = {"output_hidden_states": True, "output_attentions": True}
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, **extra)
        ref = model(ids[None], attention_mask=mask[None], labels=labels[None], **extra)
        assert out.logits.shape == (6, 64)
        assert out.loss.shape == ()
        assert torch.equal(out.logits, ref.logits[0])
        assert torch.equal(out.loss, ref.loss)
        for got, want in [*zip(out.hidden_states, ref.hidden_states, strict=True),
                          *zip(out.attentions, ref.attentions, strict=True)]:  # fmt: skip
            assert torch.equal(got, want[0])
        assert not {"cache", "past_key_values"} & set(out)  # an unbatched call builds no cache
        one = model(ids, labels=labels, loss_only=True)
        per_ex = model(ids, labels=labels, loss_only=True, per_example_loss=True)
        assert one.logits is None
        assert one.loss.shape == ()
        assert per_ex.loss.shape == ()
        assert torch.equal(per_ex.loss, one.loss)
        assert torch.equal(one.loss, model(ids[None], labels=labels[None], loss_only=True).loss)
        as_tuple = model(ids, attention_mask=mask, labels=labels, return_dict=False)
        assert isinstance(as_tuple, tuple)
        assert torch.equal(as_tuple[0], out.loss)
        assert torch.equal(as_tuple[1], out.logits)


def test_batched_calls_pass_through_untouched(toy, tiny_llama, batch):
    model = tiny_llama()
    apply_model_patches(model)
    forward = vars(model)["forward"]
    assert forward._opake_stage == "unbatched_calls"
    ids, mask, labels = batch
    with torch.no_grad():
        for call in [(ids,), (ids[:1],)]:
            got = model(*call, attention_mask=mask[: len(call[0])], labels=labels[: len(call[0])])
            ref = forward.__wrapped__(
                *call, attention_mask=mask[: len(call[0])], labels=labels[: len(call[0])]
            )
            assert torch.equal(got.logits, ref.logits)
            assert torch.equal(got.loss, ref.loss)


def test_batched_call_receives_the_very_same_arguments():
    received = []

    class Fake(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None):
            received.append((input_ids, attention_mask, labels, use_cache))
            return {"logits": input_ids.float()[..., None]}

    from opake.patches import Patcher

    model, patcher = Fake(), Patcher()
    install_unbatched_calls(model, patcher)
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)
    out = model(ids, mask)
    assert received[-1][0] is ids
    assert received[-1][1] is mask
    assert received[-1][3] is None
    assert out["logits"].shape == (2, 3, 1)
    out = model(ids[0], attention_mask=mask[0], labels=ids[0])
    assert [t.shape for t in received[-1][:3]] == [(1, 3)] * 3
    assert received[-1][3] is False  # no KV cache for an unbatched call
    assert out["logits"].shape == (3, 1)
    patcher.undo()
    assert "forward" not in vars(model)


def test_what_counts_as_unbatched():
    assert is_unbatched_call(torch.ones(4, dtype=torch.long))
    assert not is_unbatched_call(torch.ones(1, 4, dtype=torch.long))
    assert is_unbatched_call(None, torch.ones(4, 8))
    assert not is_unbatched_call(None, torch.ones(1, 4, 8))
    assert not is_unbatched_call(None, None)
    assert UNBATCHED_RANKS["labels"] == (0, 1)  # token labels, or a classifier's label


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"attention_mask": torch.ones(1, 6)}, ConfigurationError,
         r"attention_mask of shape \(1, 6\).*attention_mask\[0\].*input_ids\[None\]"),
        ({"labels": torch.zeros(1, 6, dtype=torch.long)}, ConfigurationError,
         r"labels of shape \(1, 6\).*0 or 1 dimension"),
        ({"position_ids": torch.arange(6)[None]}, ConfigurationError, r"position_ids of shape"),
        ({"attention_mask": [1] * 6}, InputTypeError, r"attention_mask as a tensor, got list"),
        ({"use_cache": True}, ConfigurationError, r"use_cache=True.*input_ids\[None\]"),
        ({"past_key_values": object()}, ConfigurationError, r"past_key_values=.*no KV cache"),
    ],
    ids=["mask_2d", "labels_2d", "position_ids_2d", "mask_list", "use_cache", "cache"],
)  # fmt: skip
def test_mismatched_unbatched_calls_raise(toy, tiny_llama, kwargs, error, match):
    model = tiny_llama()
    apply_model_patches(model)
    with pytest.raises(error, match=match):
        model(torch.zeros(6, dtype=torch.long), **kwargs)


# -- applied, removed, idempotent -----------------------------------------------------------------


def test_reported_reversible_and_not_stacked(toy, tiny_llama):
    model = tiny_llama()
    report = apply_model_patches(model)
    assert any(a.startswith("unbatched_calls") for a in report.applied)
    assert apply_model_patches(model) is report
    forward = vars(model)["forward"]
    assert forward._opake_stage == "unbatched_calls"
    assert getattr(forward.__wrapped__, "_opake_stage", None) != "unbatched_calls"  # one layer
    report.remove()
    assert "forward" not in vars(model)
    report = apply_model_patches(model, compat=False)  # a compatibility part: off with compat
    assert not any(a.startswith("unbatched_calls") for a in report.applied)
