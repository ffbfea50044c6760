"""The layer-rule registry: descriptors validated, names unique, plugins' rules tried in
priority order, explicit refusals and wrong pieces loud."""

from __future__ import annotations

import pytest
import torch

from opake.core import plugins
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.core.plugins import BookkeepingRule, hookimpl
from opake.dpsgd.bookkeeping import (
    BatchedLoss,
    Dense,
    OuterSum,
    RuleExample,
    bookkeeping_plan,
    registered_rules,
)
from opake.dpsgd.bookkeeping._registry import BUILTIN_RULES
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional


class Scale(torch.nn.Module):
    """A leaf layer ``x ⊙ w`` (no built-in closed-form rule)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _scale_matches(module, attrs):
    return isinstance(module, Scale)


def _scale_pieces(use):
    x = use.args[0].float().reshape(use.batch, -1, use.module.weight.shape[0])
    g = use.grad.float().reshape(x.shape)
    return {"weight": Dense((g * x).sum(dim=1))}


def _scale_example():
    return RuleExample(Scale(4), width=4)


def _rule(name="scale", **kw):
    args = {
        "matches": _scale_matches,
        "pieces": _scale_pieces,
        "produces": {"weight": "dense"},
        "example": _scale_example,
    }
    args.update(kw)
    return BookkeepingRule(name, **args)


class _Rules:
    def __init__(self, *rules):
        self.rules = rules

    @hookimpl
    def opake_bookkeeping_rules(self):
        return list(self.rules)


@pytest.fixture
def registry(monkeypatch):
    """A plugin manager with no entry points; rules registered by the test only."""
    monkeypatch.setenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins.reset_plugins()
    yield plugins.register_plugin
    plugins.reset_plugins()


def test_builtin_rules_are_registered_in_order_with_the_fallback_last(registry):
    names = [rule.name for rule in registered_rules()]
    assert names == list(BUILTIN_RULES)
    assert names[-1] == "per_layer"


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"name": "Bad Name"}, ConfigurationError, "invalid"),
        ({"produces": {}}, InputTypeError, "non-empty"),
        ({"produces": {"weight": "sparse"}}, ConfigurationError, "piece kind|expected one of"),
        ({"produces": {"not an attr": "dense"}}, ConfigurationError, "attribute"),
        ({"matches": 3}, InputTypeError, "callable"),
        ({"pieces": "not a path"}, ConfigurationError, "dotted path"),
        ({"priority": 1.5}, InputTypeError, "priority"),
        ({"keeps_output": "yes"}, InputTypeError, "keeps_output"),
        ({"eager": 1}, InputTypeError, "eager must be a bool"),
    ],
)
def test_descriptor_is_validated(change, error, match):
    args = {"name": "scale", **change}
    with pytest.raises(error, match=match):
        _rule(**args)


def test_eagerness_is_declared_by_the_rules_themselves(registry):
    eager = {rule.name for rule in registered_rules() if rule.eager}
    assert eager == {"layer_norm", "rms_norm"}  # PyTorch's norms: [B, d] pieces, no autograd
    assert not _rule().eager  # off unless a rule asks for it
    assert BUILTIN_RULES["layer_norm"] == "norm:LAYER_NORM"  # one implementation for both
    assert BUILTIN_RULES["rms_norm"] == "norm:RMS_NORM"


@pytest.mark.parametrize("eager", [False, True])
def test_an_eager_plugin_rule_builds_its_pieces_in_the_backward(registry, eager):
    """``eager`` (not the rule's name) decides: the pieces are built while the backward runs,
    and the clipped sum is the same either way."""
    in_backward = []

    def pieces(use):
        in_backward.append(torch._C._current_graph_task_id() != -1)
        return _scale_pieces(use)

    registry(_Rules(_rule("eager-scale", pieces=pieces, eager=eager)), "eager")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(4))
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x: fmodel(p, x).square().sum(dim=(1, 2)), fmodel)
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5, engine="bookkeeping")
    got, _ = grad_fn(params, x, state=state)
    assert in_backward
    assert set(in_backward) == {eager}
    want, _ = clipped_grad(loss, clipping_norm=0.5, engine="vmap")[0](params, x, state=state)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_plugin_rule_replaces_the_fallback_and_is_exact(registry):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(4))
    plan = bookkeeping_plan(model, ["0.weight", "1.weight"])
    assert [layer.rule for layer in plan.layers] == ["linear", "per_layer"]
    registry(_Rules(_rule()), "scale-plugin")
    plan = bookkeeping_plan(model, ["0.weight", "1.weight"])
    assert [layer.rule for layer in plan.layers] == ["linear", "scale"]
    fmodel, params = make_functional(model)

    def losses(p, x, y):
        return ((fmodel(p, x) - y) ** 2).sum(dim=(1, 2))

    x, y = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    kwargs = {"clipping_norm": 0.5, "batch_argnums": (1, 2)}
    bk, state = clipped_grad(BatchedLoss(losses, fmodel), engine="bookkeeping", **kwargs)
    got, _ = bk(params, x, y, state=state)
    vm, _ = clipped_grad(BatchedLoss(losses, fmodel), engine="vmap", **kwargs)
    want, _ = vm(params, x, y, state=state)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_duplicate_names_raise(registry):
    registry(_Rules(_rule("twice")), "one")
    registry(_Rules(_rule("twice")), "two")
    with pytest.raises(ConfigurationError, match="registered twice"):
        registered_rules()


def test_plugin_rule_named_like_a_builtin_raises(registry):
    registry(_Rules(_rule("linear")), "clash")
    with pytest.raises(ConfigurationError, match="built-in"):
        registered_rules()


def test_priority_orders_plugin_rules_before_builtins(registry):
    def any_linear(module, attrs):
        return isinstance(module, torch.nn.Linear)

    registry(_Rules(_rule("late", matches=any_linear)), "late")
    registry(_Rules(_rule("early", matches=any_linear, priority=5)), "early")
    names = [rule.name for rule in registered_rules()]
    assert names[0] == "early"
    assert names.index("late") < names.index("per_layer")
    assert names.index("late") > names.index("linear")


def test_a_refusal_is_reported_unsupported_and_auto_falls_back(registry):
    registry(_Rules(_rule(matches=lambda module, attrs: "scale layers are refused here")), "no")
    model = torch.nn.Sequential(Scale(4))
    plan = bookkeeping_plan(model, ["0.weight"])
    assert plan.unsupported == (("0", "scale layers are refused here"),)
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x: fmodel(p, x).sum(dim=(1, 2)), fmodel)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, engine="bookkeeping")
    with pytest.raises(ConfigurationError, match="refused here"):
        grad_fn(params, torch.ones(2, 3, 4), state=state)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0)
    grad_fn(params, torch.ones(2, 3, 4), state=state)
    assert grad_fn.engine == "vmap"


def test_matches_must_answer_bool_or_reason(registry):
    registry(_Rules(_rule(matches=lambda module, attrs: 1)), "odd")
    with pytest.raises(ConfigurationError, match="matches\\(\\) returned 1"):
        bookkeeping_plan(torch.nn.Sequential(Scale(4)), ["0.weight"])


@pytest.mark.parametrize(
    "pieces",
    [
        lambda use: {},  # nothing for the weight
        lambda use: {"weight": OuterSum(use.grad, use.args[0])},  # not the declared kind
    ],
)
def test_wrong_pieces_are_loud(registry, pieces):
    registry(_Rules(_rule(pieces=pieces)), "wrong")
    model = torch.nn.Sequential(Scale(4))
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x: fmodel(p, x).sum(dim=(1, 2)), fmodel)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, engine="bookkeeping")
    with pytest.raises(OperationError, match="its rule 'scale' produced"):
        grad_fn(params, torch.randn(2, 3, 4), state=state)


def test_auto_falls_back_to_vmap_when_recording_fails_and_logs_why(registry, caplog):
    import logging

    def refuse(use):
        raise use.fail("this layer cannot be recorded")

    registry(_Rules(_rule(pieces=refuse)), "refusing")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(4))
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x: fmodel(p, x).square().sum(dim=(1, 2)), fmodel)
    x = torch.randn(3, 2, 4)
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5)
    with caplog.at_level(logging.INFO, logger="opake.core"):
        got, _ = grad_fn(params, x, state=state)
        again, _ = grad_fn(params, x, state=state)
    assert grad_fn.engine == "vmap"
    text = " ".join(r.getMessage() for r in caplog.records if r.name == "opake.core")
    assert "this layer cannot be recorded" in text
    want, _ = clipped_grad(loss, clipping_norm=0.5, engine="vmap")[0](params, x, state=state)
    for key in want:
        torch.testing.assert_close(got[key], want[key])
        torch.testing.assert_close(again[key], want[key])
    strict, state = clipped_grad(loss, clipping_norm=0.5, engine="bookkeeping")
    with pytest.raises(OperationError, match="cannot be recorded"):
        strict(params, x, state=state)
