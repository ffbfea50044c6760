"""The attacks on the clipping bound that a rounding *model* does not cover (issue classes 1–4),
reproduced end to end, and the certified bounds checked against an exact oracle.

Each end-to-end test isolates one example's contribution to the clipped sum with
``example_mask`` (the other examples then add exact zeros) and asserts ``‖contribution‖ ≤ C``
to within the oracle's own fp64 rounding (``1e-12``) — the proven bound, not a tolerance. The
contribution is the fp32 tensor the engine returns; its norm is taken in fp64 of the exact
squares. Each attack made the engines of earlier releases exceed C (the factor is in the
test's docstring); every test here fails on that code.
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

EXACT = 1.0 + 1e-12  # the oracle's fp64 rounding of a norm: nothing else is tolerated


def _contributions(grad_fn, state, args, batch):
    """Each example's contribution, after one ordinary call on a benign batch of the same
    shapes: the engine's first-call check then ran on data an attacker did not choose (an
    attack arrives in a later step), so only the proof stands between it and the sum."""
    benign = tuple(
        torch.randn_like(a) * 0.1 if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args[1:]
    )
    grad_fn(args[0], *benign, state=state)
    return [
        testing.exact_norm(testing.contribution(grad_fn, args, state=state, index=i, batch=batch))
        for i in range(batch)
    ]


def _mse(fmodel):
    def losses(p, x, y):
        return ((fmodel(p, x) - y) ** 2).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel)


def _outer(fmodel):
    def losses(p, x, y):  # the output gradients are the attacker's y
        return (fmodel(p, x) * y).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel)


# ---------------------------------------------------------------- 1. underflow on the Gram route
def _underflow_case(width: int, steps: int, *, bias: bool):
    """An ``nn.Linear(width, width)`` with squared error, data only: the attacker's inputs are
    tiny (their fp32 squares underflow) and its targets huge (≈ √(FLT_MAX/width)), so the
    input Gram matrix is exactly zero while the gradient's norm is several C. Earlier code:
    7.5·C at width 1024, T 512 (the loose-bound test read ``0 > 0``)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(width, width, bias=bias)
    fmodel, params = make_functional(layer)
    big = math.sqrt(3.4e38 / width) / 2
    x = torch.randn(2, steps, width) * 0.1
    y = torch.randn(2, steps, width) * 0.1
    # one tiny input, its sign alternating along the sequence (its fp32 squares are 0), and
    # huge targets alternating with it: Σ_t g_t = 0 (the bias sees nothing), Σ_t g_t x_tᵀ adds up
    sign = torch.tensor([(-1.0) ** t for t in range(steps)])[:, None]
    x[1] = 1.0e-23 * torch.randn(width).sign() * sign
    y[1] = -big * torch.randn(width).sign() * sign
    return _mse(fmodel), params, x, y


@pytest.mark.parametrize("engine", ["bookkeeping", "auto"])
def test_underflowing_gram_entries_do_not_escape_clipping(engine):
    loss, params, x, y = _underflow_case(1024, 512, bias=True)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine=engine, check_unused=False
    )
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 1.0 * EXACT, norm
    assert grad_fn.engine == "bookkeeping"


def test_underflow_is_an_absolute_leak_and_stays_clipped_at_a_small_bound():
    """Earlier code: 75·C at C = 0.1 (the leak did not scale with C)."""
    loss, params, x, y = _underflow_case(512, 256, bias=False)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.1, batch_argnums=(1, 2), engine="bookkeeping"
    )
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 0.1 * EXACT, norm


def test_underflow_under_bf16_autocast_stays_clipped():
    """The same inputs with crafted output gradients (bf16 keeps fp32's exponent range)."""
    _, params, x, y = _underflow_case(512, 256, bias=True)
    y[1] *= 4.0  # a norm of about 2·C
    torch.manual_seed(0)
    fmodel, params = make_functional(torch.nn.Linear(512, 512))
    grad_fn, state = clipped_grad(
        _outer(fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms = _contributions(grad_fn, state, (params, x, y), 2)
    assert max(norms) <= 1.0 * EXACT, norms


# ------------------------------------------- 2. systematic rounding in long fp32 reductions
def _absorption_inputs(width: int) -> torch.Tensor:
    """Two tokens that agree on one 1.0 entry and differ in the sign of ``width − 1`` entries of
    ``2⁻¹²``: in a sequential fp32 dot product every ``+2⁻²⁴`` after the 1.0 is a tie that
    round-half-to-even absorbs, while every ``−2⁻²⁴`` is kept, so the Gram form of
    ``‖x₁ − x₂‖²`` comes out about half its value."""
    small = torch.full((width - 1,), 2.0**-12)
    x1 = torch.cat([torch.ones(1), small])
    x2 = torch.cat([torch.ones(1), -small])
    return torch.stack([x1, x2])


@pytest.mark.parametrize("width", [16384, 65536])
def test_tie_absorption_in_long_gram_reductions_stays_clipped(width):
    """Crafted output gradients of opposite sign on the two tokens. Earlier code: 1.16·C at
    in_features 16384, 1.68·C at 65536."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(width, 4, bias=False)
    fmodel, params = make_functional(layer)
    x = torch.randn(2, 2, width) * 0.01
    y = torch.randn(2, 2, 4)
    x[1] = _absorption_inputs(width)
    g = torch.tensor([1.0, -1.0, 0.5, 2.0]) * 1e3
    y[1, 0], y[1, 1] = g, -g
    grad_fn, state = clipped_grad(
        _outer(fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 1.0 * EXACT, norm


def test_tie_absorption_with_data_only_targets_stays_clipped():
    """The same inputs through a squared error whose targets make the two output gradients
    opposite (the attacker controls only its example's data)."""
    width = 16384
    layer = torch.nn.Linear(width, 4, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    fmodel, params = make_functional(layer)
    x = torch.zeros(2, 2, width)
    x[0] = torch.randn(2, width) * 0.01
    x[1] = _absorption_inputs(width)
    y = torch.zeros(2, 2, 4)
    y[0] = torch.randn(2, 4)
    target = torch.tensor([1.0, -1.0, 0.5, 2.0]) * 1e3
    y[1, 0], y[1, 1] = target, -target
    grad_fn, state = clipped_grad(
        _mse(fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine="auto"
    )
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 1.0 * EXACT, norm


# ---------------------------------------------------------- 3. the vmap engine's leaf norms
class _Long(torch.nn.Module):
    """One leaf of ``2²⁴`` entries whose per-example gradient is the example itself."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum(dim=-1)


def test_a_leaf_of_2_24_entries_is_measured_in_full():
    """A few large entries, then many small ones that a fp32 reduction absorbs. Earlier code:
    the norm 5.7 % low, the example contributed 1.06·C."""
    n = 1 << 24
    model = _Long(n)
    fmodel, params = make_functional(model)

    def loss(p, x):
        return fmodel(p, x[None])[0]

    x = torch.full((1, n), 2.0**-12)
    x[0, :4] = 1.0
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1,), engine="vmap")
    [norm] = _contributions(grad_fn, state, (params, x), 1)
    assert norm <= 1.0 * EXACT


def test_dense_pieces_of_book_keeping_are_measured_in_full():
    """A bias of ``2²²`` entries (a Dense piece): earlier code 1.016·C."""
    n = 1 << 22
    layer = torch.nn.Linear(1, n)
    fmodel, params = make_functional(layer)
    params = {"bias": params["bias"]}
    frozen = {"weight": layer.weight.detach()}

    def losses(p, x, y):
        return (fmodel({**p, **frozen}, x) * y).sum(dim=(1, 2))

    x = torch.ones(1, 1, 1)
    y = torch.full((1, 1, n), 2.0**-12)
    y[0, 0, :4] = 1.0
    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    [norm] = _contributions(grad_fn, state, (params, x, y), 1)
    assert norm <= 1.0 * EXACT


# ------------------------------------------------------------- flush-to-zero, denormals-are-zero
@pytest.mark.usefixtures("flush_denormal")
@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
def test_with_flush_to_zero_the_bound_still_holds(method):
    """Products near ``2⁻¹²⁶`` flushed to zero, subnormal inputs read as zero."""
    loss, params, x, y = _underflow_case(256, 64, bias=True)
    x[0] = 2.0**-130 * torch.randn(64, 256).sign()  # subnormal inputs
    y[0] = 2.0**100 * torch.randn(64, 256)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), engine=method)
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 1.0 * EXACT, norm


# ---------------------------------------------------------- 4. third-party rules outside the proof
class _Scale(torch.nn.Module):
    """``y = x ⊙ w`` (a plugin's own layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _LyingOp:
    """An implicit operator that adds the true per-example gradients but reports norms 100×
    too small whenever an example's gradient is large (a uniform understatement would be
    caught by the engine's check; a conditional one is not)."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g.float()

    @property
    def batch(self) -> int:
        return int(self.g.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.g.shape[1]), 1

    def _sq(self) -> torch.Tensor:
        sq = self.g.double().square().sum(dim=1)
        return torch.where(sq > 100.0, sq * 1e-4, sq)

    def sq_norms(self):
        return self._sq(), None

    def abs_norms(self):
        return self._sq().sqrt()

    def weighted_sum(self, weights, keep=None):
        w = weights if keep is None else torch.where(keep, weights, 0.0)
        g = self.g if keep is None else torch.where(keep[:, None], self.g, 0.0)
        return (w[:, None] * g).sum(dim=0)[:, None], None

    def inner_outer(self, a, b):
        raise AssertionError("the test's layer has no tied use: no cross term is asked for")

    def example_rows(self, index, start, stop):
        return self.g[index, start:stop, None].double()


def _lying_matches(module, attrs):
    return isinstance(module, _Scale)


def _lying_pieces(use):
    from opake.dpsgd.bookkeeping.rules import Implicit

    x = use.args[0].float()
    g = (use.grad.float() * x).reshape(use.batch, -1, x.shape[-1]).sum(dim=1)
    return {"weight": Implicit(_LyingOp(g))}


def _lying_example():
    from opake.dpsgd.bookkeeping import RuleExample

    return RuleExample(_Scale(4), width=4)


@pytest.fixture
def lying_rule(monkeypatch):
    from opake.core import plugins
    from opake.core.plugins import BookkeepingRule, hookimpl

    class _Plugin:
        @hookimpl
        def opake_bookkeeping_rules(self):
            return [
                BookkeepingRule(
                    "lying-scale",
                    matches=_lying_matches,
                    pieces=_lying_pieces,
                    produces={"weight": "implicit"},
                    example=_lying_example,
                    priority=5,
                )
            ]

    monkeypatch.setenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("OPAKE_TRUSTED_RULES", raising=False)
    plugins.reset_plugins()
    plugins.register_plugin(_Plugin(), "lying")
    yield
    plugins.reset_plugins()


@pytest.mark.usefixtures("lying_rule")
def test_a_plugin_rule_with_implicit_pieces_is_used_only_when_trusted(caplog):
    """Earlier code used such a rule and let its example contribute 100·C. Untrusted, its
    layer goes to the per-layer vmap rule (logged), and the bound holds; trusted, the plan uses
    it (outside the proof: the user vouched for it)."""
    from opake.dpsgd.bookkeeping import bookkeeping_plan

    model = torch.nn.Sequential(_Scale(4))
    fmodel, params = make_functional(model)
    with caplog.at_level("INFO", logger="opake.core"):
        plan = bookkeeping_plan(model, list(params))
    assert [layer.rule for layer in plan.layers] == ["per_layer"]
    assert "outside the clipping proof" in caplog.text
    trusted = bookkeeping_plan(model, list(params), trusted=("lying-scale",))
    assert [layer.rule for layer in trusted.layers] == ["lying-scale"]

    x = torch.randn(2, 3, 4) * 0.1
    y = torch.randn(2, 3, 4) * 0.1
    x[1], y[1] = 10.0, 10.0  # a large gradient: the operator would report it 100× too small
    grad_fn, state = clipped_grad(
        _outer(fmodel), clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    for norm in _contributions(grad_fn, state, (params, x, y), 2):
        assert norm <= 1.0 * EXACT, norm
