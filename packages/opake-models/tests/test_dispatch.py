"""End to end through opake.patches.apply_model_patches: dispatch, errors, report."""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.models import family_names, family_spec
from opake.models.testing import tiny_model
from opake.patches import apply_model_patches, model_patch_report


def test_unsupported_model_type_names_the_families_and_the_plugin_guide():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "starcoder2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigurationError) as err:
        apply_model_patches(model)
    message = str(err.value)
    assert "'starcoder2' is not supported" in message
    for name in family_names():
        assert name in message
    assert "docs/guide/plugins.md" in message
    assert model_patch_report(model) is None
    assert "forward" not in vars(model)


def test_report_lists_family_and_shared_patches():
    model = tiny_model("qwen2").train()
    report = apply_model_patches(model, kernels="chunked")
    applied = "\n".join(report.applied)
    assert report.family == "qwen2"
    assert "rms_norm: 5 Qwen2RMSNorm modules" in applied
    assert "swiglu: 2 Qwen2MLP modules (silu)" in applied
    assert "sliding window of 4 keys on sliding layers" in applied
    assert "loss_only" in applied
    assert "attention_mask" in applied
    assert {"rms_norm", "swiglu", "linear_cross_entropy"} <= set(report.kernels)
    assert "rope" in report.skipped
    assert any("dropout" in note for note in report.notes) is (model.config.attention_dropout > 0)
    report.remove()
    assert not report.active


def test_performance_false_keeps_only_compat():
    model = tiny_model("llama")
    report = apply_model_patches(model, performance=False)
    assert report.kernels == {}
    assert report.skipped["kernels"] == "performance=False"
    assert report.skipped["loss_only"] == "performance=False"
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = model(input_ids=ids, attention_mask=mask)
    assert out.logits.shape == (1, 4, 128)
    report.remove()


@pytest.mark.parametrize("family", ["gpt2", "gemma", "cohere"])
def test_tied_weight_gradient_is_the_sum_of_both_uses(family):
    """Per example, the gradient of the tied embedding/output weight under the patched
    loss-only path equals embedding-use + head-use gradients of an untied copy."""
    from opake.core.testing import per_example_grads_loop
    from opake.functional import make_functional

    spec = family_spec(family)
    tied = tiny_model(family)
    untied = tiny_model(family, tie_word_embeddings=False)
    untied.load_state_dict(tied.state_dict(), strict=False)
    embedding = spec.head.embedding + ".weight"
    head = spec.head.lm_head + ".weight"
    with torch.no_grad():
        untied.get_parameter(head).copy_(tied.get_parameter(embedding))
    apply_model_patches(tied, kernels="chunked")
    assert vars(tied)["_opake_family_report"].tied is True

    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(3))
    fmodel, params = make_functional(tied)
    assert head not in params  # one parameter, listed once

    def loss(p, x):
        return fmodel(p, input_ids=x[None], labels=x[None], loss_only=True).loss

    with torch.no_grad():
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    ref_fmodel, ref_params = make_functional(untied)
    expected, _ = per_example_grads_loop(
        lambda p, x: ref_fmodel(p, input_ids=x[None], labels=x[None]).loss, (ref_params, ids)
    )
    for i, ref in enumerate(expected):
        both = ref[embedding] + ref[head]
        torch.testing.assert_close(grads[embedding][i], both, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(grads[embedding][i], ref[embedding], atol=1e-6)
