"""The norm layers of every family have a closed-form book-keeping rule, declared by the
family spec (no per-layer vmap fallback), and a declaration that does not fit is loud."""

from __future__ import annotations

import logging

import pytest
import torch

from opake.dpsgd.bookkeeping import BatchedLoss, bookkeeping_plan
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.models import family_names, family_spec
from opake.models._norm_rule import declared_norms
from opake.models.testing import tiny_model


@pytest.mark.parametrize("family", family_names())
def test_no_family_needs_the_fallback_for_its_norms(family):
    spec = family_spec(family)
    assert spec.norm is not None
    with torch.device("meta"):
        model = tiny_model(spec)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    plan = bookkeeping_plan(model, names)
    modules = dict(model.named_modules())
    norms = [
        layer for layer in plan.layers if type(modules[layer.module]).__name__ == spec.norm.module
    ]
    assert norms, f"{family}: no {spec.norm.module} reads a trainable parameter"
    for layer in norms:
        assert layer.rule in ("family_norm", "layer_norm", "rms_norm"), (family, layer)


def test_the_family_norm_rule_declares_itself_eager():
    from opake.dpsgd.bookkeeping import registered_rules

    rules = {rule.name: rule for rule in registered_rules()}
    assert rules["family_norm"].eager  # [B, d] pieces built in the backward, like the norms
    assert not rules["fused_experts"].eager


def test_every_declared_norm_class_is_one_formula():
    norms = declared_norms()
    assert norms["LlamaRMSNorm"].offset == 0.0
    assert norms["GemmaRMSNorm"].offset == 1.0
    assert norms["CohereLayerNorm"].kind == "layer"


def _llama_norm_model(forward=None):
    model = tiny_model("llama", num_hidden_layers=1)
    norm = model.model.norm
    if forward is not None:
        norm.forward = forward.__get__(norm)
    return model


def _losses(model):
    fmodel, params = make_functional(model)

    def losses(p, ids):
        logits = fmodel(p, input_ids=ids, use_cache=False).logits
        return logits.float().square().mean(dim=(1, 2))

    return BatchedLoss(losses, fmodel), params


def test_a_norm_that_is_not_its_declared_formula_is_loud_and_auto_falls_back(caplog):
    def doubled(self, x):  # x̂ ⊙ 2w: not what LlamaRMSNorm declares
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return 2.0 * self.weight * h

    model = _llama_norm_model(doubled)
    loss, params = _losses(model)
    ids = torch.randint(3, 100, (2, 5))
    strict, state = clipped_grad(loss, clipping_norm=1.0, engine="bookkeeping")
    with pytest.raises(Exception, match="as its norm rule declares"):
        strict(params, ids, state=state)
    auto, state = clipped_grad(loss, clipping_norm=1.0)
    with caplog.at_level(logging.INFO, logger="opake.core"):
        got, _ = auto(params, ids, state=state)
    assert auto.engine == "vmap"
    assert any("as its norm rule declares" in r.getMessage() for r in caplog.records)
    want, _ = clipped_grad(loss, clipping_norm=1.0, engine="vmap")[0](params, ids, state=state)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
