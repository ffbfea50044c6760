"""The declarative spec: validation, and one logit transform for both head paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError
from opake.kernels import cross_entropy
from opake.models import (
    Attention,
    CausalLMHead,
    ClassifierHead,
    FamilySpec,
    LogitTransform,
    Mlp,
    Norm,
    Rope,
    family_names,
    family_spec,
)


def _spec(**overrides):
    kwargs = {
        "name": "toy",
        "model_types": ("toy",),
        "layer": "ToyLayer",
        "mlp": Mlp("swiglu", "ToyMLP"),
        "norm": Norm("rms", "ToyRMSNorm", "pre"),
        "rope": Rope("rotate_half", "ToyRotaryEmbedding"),
        "attention": Attention("causal"),
        "head": CausalLMHead(),
        "models": ("ToyForCausalLM",),
        "tiny_config": {"hidden_size": 8},
    }
    kwargs.update(overrides)
    return FamilySpec(**kwargs)


def test_valid_spec_is_frozen_and_read_only():
    spec = _spec()
    assert spec.task == "causal_lm"
    with pytest.raises(AttributeError):
        spec.name = "other"
    with pytest.raises(TypeError):
        spec.tiny_config["hidden_size"] = 16


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Mlp("relu", "M"), ConfigurationError, "kind='relu'"),
        (lambda: Mlp("swiglu", "M", gate=None), ConfigurationError, "needs gate and up"),
        (lambda: Mlp("swiglu", "M", down=None), ConfigurationError, "down projection"),
        (lambda: Mlp("gelu", "bad name"), ConfigurationError, "not an identifier"),
        (lambda: Norm("rms", "N", "middle"), ConfigurationError, "placement='middle'"),
        (lambda: Norm("rms", "N", "pre", offset="1"), InputTypeError, "offset"),
        (lambda: Rope("none", "R"), ConfigurationError, "exactly when"),
        (lambda: Rope("rotate_half"), ConfigurationError, "exactly when"),
        (lambda: Attention("sideways"), ConfigurationError, "mask='sideways'"),
        (lambda: CausalLMHead(lm_head="a..b"), ConfigurationError, "dotted attribute path"),
        (lambda: CausalLMHead(tied="yes"), InputTypeError, "tied"),
        (lambda: _spec(model_types="toy"), InputTypeError, "model_types"),
        (lambda: _spec(mlp="swiglu"), InputTypeError, "mlp must be a Mlp"),
        (lambda: _spec(head=ClassifierHead()), ConfigurationError, "bidirectional"),
        (lambda: _spec(models=()), InputTypeError, "models"),
        (lambda: _spec(tiny_config=[1]), InputTypeError, "tiny_config"),
    ],
)
def test_invalid_specs_raise_typed_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_transform_read_from_config():
    head = CausalLMHead(logit_scale="s", logit_divisor="d", final_softcap="c")
    t = head.transform(SimpleNamespace(s=0.5, d=4, c=30.0))
    assert t == LogitTransform(0.5, 4.0, 30.0)
    # neutral values are dropped, a non-positive cap is off (as in transformers)
    assert head.transform(SimpleNamespace(s=1.0, d=1.0, c=0.0)).identity
    assert head.transform(SimpleNamespace(s=None, d=None, c=None)).identity
    with pytest.raises(ConfigurationError, match="divide logits by 0"):
        head.transform(SimpleNamespace(s=1.0, d=0.0, c=None))
    with pytest.raises(ConfigurationError, match="not a number"):
        head.transform(SimpleNamespace(s="big", d=None, c=None))


@pytest.mark.parametrize(
    "transform",
    [
        LogitTransform(0.5, None, None),
        LogitTransform(None, 4.0, None),
        LogitTransform(2.0, 3.0, 1.5),
    ],
)
def test_logits_path_and_kernel_path_compute_the_same_function(transform):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 11, generator=g) * 5
    labels = torch.tensor([0, 3, -100, 10, 7, 1])
    via_logits = torch.nn.functional.cross_entropy(transform.apply(z), labels)
    via_kernel = cross_entropy(z, labels, backend="torch", **transform.kernel_kwargs())
    torch.testing.assert_close(via_logits, via_kernel, rtol=1e-6, atol=1e-6)


EXPECTED_TRANSFORMS = {
    "cohere": LogitTransform(0.5, None, None),
    "granite": LogitTransform(None, 4.0, None),
    "gemma2": LogitTransform(None, None, 3.0),
    "gemma3": LogitTransform(None, None, 3.0),
    "cohere2": LogitTransform(0.5, None, None),
}
CAUSAL = [n for n in family_names() if family_spec(n).task == "causal_lm"]


@pytest.mark.parametrize("family", CAUSAL)
def test_family_transform_reproduces_transformers_logits(family):
    """The spec's transform applied to ``lm_head(backbone(x))`` is transformers' logits path:
    the loss-only path (which gets the same transform) cannot drift from it."""
    from opake.models.testing import tiny_model

    spec = family_spec(family)
    model = tiny_model(family)
    transform = spec.head.transform(model.config)
    assert transform == EXPECTED_TRANSFORMS.get(family, LogitTransform(None, None, None))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = getattr(model, spec.head.backbone)(input_ids=ids).last_hidden_state
        raw = getattr(model, spec.head.lm_head)(hidden)
    if not transform.identity:
        assert not torch.allclose(raw, logits)
    torch.testing.assert_close(transform.apply(raw), logits, rtol=1e-6, atol=1e-6)
