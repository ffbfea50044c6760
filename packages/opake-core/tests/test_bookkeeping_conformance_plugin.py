"""The public conformance harness (``opake.core.testing.check_rule``) on a third party's rule.

Each test writes a tiny rule module into ``tmp_path`` (outside the repository, not installed,
not registered), imports it and runs the harness on its ``RULE`` in one call, as a plugin
author does in the plugin's own tests; a rule that computes the wrong gradient, or whose
example its ``matches`` refuses, fails the harness.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from opake.core import testing
from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.bookkeeping import registered_rules

RULE_MODULE = '''
"""A third party's layer and its book-keeping rule."""

import torch

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping.rules import Dense, RuleExample, first_input


class Gate(torch.nn.Module):
    """``x ⊙ scale`` per token."""

    def __init__(self, width):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.scale


def matches(module, attrs):
    return type(module) is {match}


def pieces(use):
    width = use.module.scale.shape[0]
    x = first_input(use).float().reshape(use.batch, -1, width)
    g = use.grad.float().reshape(use.batch, -1, width)
    return {{"scale": Dense({piece})}}


def example():
    return RuleExample(Gate(8), width=8)


RULE = BookkeepingRule(
    "{name}",
    matches="{module}:matches",
    pieces="{module}:pieces",
    produces={{"scale": "dense"}},
    example="{module}:example",
    eager={eager},
)
'''

RIGHT = "(g * x).sum(dim=1)"

IMPLICIT_MODULE = '''"""A third party's matrix layer; an operator of its own holds its gradients."""

import torch

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping.rules import RuleExample, first_input, flat_batch


class Mat(torch.nn.Module):
    def __init__(self, inp, out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out, inp) / inp**0.5)

    def forward(self, x):
        return x @ self.weight.T


class Held:
    """Per-example gradients ``G_i = Σ_t g_t ⊗ x_t``, held materialised."""

    def __init__(self, g, x):
        self.g, self.x = g.float(), x.float()
        self.grads = torch.einsum("btr,btc->brc", self.g, self.x)

    @property
    def batch(self):
        return self.grads.shape[0]

    @property
    def shape(self):
        return tuple(self.grads.shape[1:])

    def sq_norms(self):
        return self.grads.double().square().sum(dim=(1, 2)).float(), None

    def weighted_sum(self, weights, keep=None):
        {weighted_sum}

    def inner_outer(self, a, b):
        if a.dtype == torch.int64:
            rows = self.grads.shape[1]
            a = torch.nn.functional.one_hot(a, rows).to(b.dtype)
        return (self.grads * torch.einsum("bsr,bsc->brc", a.float(), b.float())).sum(dim=(1, 2))

    def abs_norms(self):
        return (self.g.double().norm(dim=-1) * self.x.double().norm(dim=-1)).sum(dim=1)

    def example_rows(self, index, start, stop):
        g, x = self.g[index].double(), self.x[index].double()
        return g[:, start:stop].T @ x


def matches(module, attrs):
    return type(module) is Mat


def pieces(use):
    from opake.dpsgd.bookkeeping.rules import Implicit

    g = flat_batch(use.grad, use.batch, use.layer.module)
    x = flat_batch(first_input(use), use.batch, use.layer.module)
    return {{"weight": Implicit(Held(g, x))}}


def example():
    return RuleExample(Mat(6, 4), width=6)


RULE = BookkeepingRule(
    "{name}",
    matches=matches,
    pieces=pieces,
    produces={{"weight": "implicit"}},
    example=example,
)
'''

#: ``Held.weighted_sum``: examples not kept (non-finite ones) must contribute nothing
DROPS_UNKEPT = """grads = self.grads if keep is None else self.grads[keep]
        w = weights.float() if keep is None else weights.float()[keep]
        return torch.einsum("b,brc->rc", w, grads), None"""
#: a zero weight times a non-finite gradient is NaN: the clipped sum is poisoned
MULTIPLIES_BY_KEEP = """w = weights.float() if keep is None else weights.float() * keep.float()
        return torch.einsum("b,brc->rc", w, self.grads), None"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Write a rule module into ``tmp_path`` and import it: ``make(name, piece=, match=)``."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(name, *, piece=RIGHT, match="Gate", eager=False):
        module = f"third_party_{name.replace('-', '_')}"
        source = RULE_MODULE.format(name=name, module=module, piece=piece, match=match, eager=eager)
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, module, raising=False)
        importlib.invalidate_caches()
        return importlib.import_module(module).RULE

    return make


@pytest.mark.parametrize("eager", [False, True])
def test_a_rule_from_outside_the_repository_passes_the_harness(third_party, eager):
    rule = third_party("tmp-gate", eager=eager)
    assert "tmp-gate" not in {r.name for r in registered_rules()}
    assert testing.check_rule(rule, max_examples=4) == 1
    # registered for the check only
    assert "tmp-gate" not in {r.name for r in registered_rules()}


@pytest.mark.parametrize(
    "piece",
    [
        "(g * x)[:, 0]",  # the first token only
        "2 * (g * x).sum(dim=1)",  # twice the gradient (still clipped: only utility is lost)
    ],
)
def test_a_rule_with_the_wrong_gradient_fails_the_harness(third_party, piece):
    rule = third_party("tmp-wrong-gate", piece=piece)
    with pytest.raises((AssertionError, OperationError)):
        testing.check_rule(rule, max_examples=4)
    assert "tmp-wrong-gate" not in {r.name for r in registered_rules()}


def test_a_rule_that_does_not_match_its_example_fails_the_harness(third_party):
    rule = third_party("tmp-blind-gate", match="torch.nn.Linear")
    with pytest.raises(AssertionError, match="per_layer"):
        testing.check_rule(rule, max_examples=1)


def test_a_rule_with_implicit_pieces_is_checked_trusted_not_skipped(tmp_path, monkeypatch):
    """A third party's operator is outside the clipping proof, so the engine skips its rule
    unless trusted; the harness trusts the rule it checks (plan and clipping alike)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, body in (("tmp-held", DROPS_UNKEPT), ("tmp-leaky-held", MULTIPLIES_BY_KEEP)):
        module = f"third_party_{name.replace('-', '_')}"
        source = IMPLICIT_MODULE.format(name=name, weighted_sum=body)
        (tmp_path / f"{module}.py").write_text(source)
        monkeypatch.delitem(sys.modules, module, raising=False)
    importlib.invalidate_caches()
    held = importlib.import_module("third_party_tmp_held").RULE
    assert testing.check_rule(held, max_examples=4) == 1
    leaky = importlib.import_module("third_party_tmp_leaky_held").RULE
    with pytest.raises(AssertionError):  # a non-finite example reaches the sum
        testing.check_rule(leaky, max_examples=4)


def test_check_rule_by_name_and_its_refusals(third_party):
    assert testing.check_rule("rms_norm", max_examples=1) == 1
    with pytest.raises(ConfigurationError, match="no registered book-keeping rule"):
        testing.check_rule("tmp-nowhere")
    clash = third_party("linear")
    with pytest.raises(ConfigurationError, match="already registered"):
        testing.check_rule(clash)
