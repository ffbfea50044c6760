"""One-piece Gram-route leaves through the fused (and compiled) bound arithmetic.

``LeafBoundsFn`` evaluates a linear layer's leaf bounds with one pure tensor function
(``leaf_arith``), compiled under ``DPTraining(compile=True)``. The claims:

- eager, it returns exactly (bit for bit) what the general route (``leaf_bounds``) returns;
- compiled, every bound still holds against an exact rational oracle — ``‖added‖ ≤ w·bound +
  slack`` for the tensor the clipped sum really receives, inputs generated to break floating
  point (subnormal, flushed and near-overflow values, cancelling tokens, ties), with flush-to-zero
  off and on: Inductor's reordered reductions stay inside the proof;
- leaves it does not cover (several pieces, an embedding's ids, the materialised route) and
  leaves whose token norms overflow take the general route; a compiled call that fails turns
  compilation off, logged, and the bounds are the eager ones.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from opake.dpsgd.bookkeeping._certify import leaf_bounds
from opake.dpsgd.bookkeeping._fused import LeafBoundsFn, leaf_arith, leaf_constants
from opake.dpsgd.bookkeeping._pieces import Dense, OuterSum, add_weighted
from opake.dpsgd.certify import GramCache, full_precision, gram, wide

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
]

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    # no explain phase: it traces every line, and Dynamo would retrace the compiled arithmetic
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
SCALES = st.sampled_from([-140, -130, -100, -60, -12, 0, 12, 60, 62, 63])
PATTERNS = st.sampled_from(["random", "repeated", "alternating", "cancelling", "ties", "mixed"])
FIELDS = ("sq", "bound", "slack", "loose", "rounding")

# the exact-rational oracle's generator of adversarial tokens (one copy, beside its oracle)
_ORACLE = Path(__file__).with_name("test_privacy_certify_oracle.py")
_spec = importlib.util.spec_from_file_location("_certify_oracle_inputs", _ORACLE)
assert _spec is not None
assert _spec.loader is not None
_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_oracle)
_tokens = _oracle._tokens


def _piece(case) -> OuterSum:
    """Two examples; rows and cols ≥ 2·steps, so the Gram route is the cheaper one."""
    steps, rows, cols, pa, pb, sa, sb, seed = case
    gen = torch.Generator().manual_seed(seed)
    a = torch.stack([_tokens(gen, steps, rows, pa, sa) for _ in range(2)])
    b = torch.stack([_tokens(gen, steps, cols, pb, sb) for _ in range(2)])
    return OuterSum(a, b)


CASE = st.tuples(
    st.sampled_from([2, 3]),  # tokens: one compiled graph each
    st.integers(6, 10),  # rows
    st.integers(6, 10),  # cols
    PATTERNS,
    PATTERNS,
    SCALES,
    SCALES,
    st.integers(0, 2**16),
)


@pytest.fixture(params=[False, True], ids=["ieee", "ftz-daz"])
def flush(request):
    if request.param:
        request.getfixturevalue("flush_denormal")
    return request.param


@pytest.fixture(scope="module")
def compiled_arith():
    return torch.compile(leaf_arith, dynamic=False, fullgraph=True)


def _exact_added_sq(added: torch.Tensor) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in added.double().flatten().tolist()), Fraction(0))


def _exact_grad_sq(piece: OuterSum, index: int) -> Fraction:
    fa = [[Fraction(float(v)) for v in row] for row in piece.a[index].tolist()]
    fb = [[Fraction(float(v)) for v in row] for row in piece.b[index].tolist()]
    total = Fraction(0)
    for r in range(len(fa[0])):
        for c in range(len(fb[0])):
            entry = sum(fa[t][r] * fb[t][c] for t in range(len(fa)))
            total += entry * entry
    return total


@pytest.fixture(params=["fp64-gram", "fp32-gram"])
def route(request, monkeypatch):
    """Small Gram matrices are formed in fp64; ``fp32-gram`` forces the blocked fp32 products
    (and their error model) that larger layers get."""
    if request.param == "fp32-gram":
        monkeypatch.setattr("opake.dpsgd.certify._gram.WIDE_MACS", 0)
    return request.param


@SETTINGS
@given(case=CASE, k=st.integers(0, 2**20))
def test_compiled_leaf_bounds_hold_against_the_exact_oracle(flush, route, compiled_arith, case, k):
    piece = _piece(case)
    rows, cols = piece.shape
    w = k * 2.0**-20
    with full_precision():
        consts = torch.tensor(leaf_constants(piece, rows * cols), dtype=torch.float64)
        finite, _, bound, slack, *_ = compiled_arith(gram(piece.a), gram(piece.b), consts)
        weights = torch.tensor([w, 0.7], dtype=torch.float32)
        added = torch.zeros(rows, cols)
        add_weighted(piece, weights, torch.tensor([True, False]), added)
    if not bool(finite):  # an overflowed Gram block: the general route recomputes it
        return
    exact = _exact_grad_sq(piece, 0)
    if math.isfinite(float(bound[0])):
        assert exact <= Fraction(float(bound[0])) ** 2
    limit = float(weights[0]) * float(bound[0]) + float(slack[0])
    if math.isfinite(limit) and bool(torch.isfinite(added).all()):
        assert _exact_added_sq(added) <= Fraction(limit) ** 2


@SETTINGS
@given(case=CASE)
def test_eager_fused_bounds_equal_the_general_route_bit_for_bit(flush, case):
    piece = _piece(case)
    numel = piece.shape[0] * piece.shape[1]
    with full_precision():
        ref = leaf_bounds([piece], numel, trusted=True)
        got = LeafBoundsFn()([piece], numel, GramCache())
    for name in FIELDS:
        assert torch.equal(getattr(ref, name), getattr(got, name)), name


def _layer(batch: int = 4, steps: int = 16, rows: int = 96, cols: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, steps, rows, generator=gen)
    b = torch.randn(batch, steps, cols, generator=gen)
    return OuterSum(a, b)


def test_compiled_fused_bounds_are_the_eager_ones_up_to_reduction_order():
    fused = LeafBoundsFn(compiled=True)
    for seed, (rows, cols) in enumerate([(96, 64), (64, 96), (300, 64)]):
        piece = _layer(rows=rows, cols=cols, seed=seed)
        with full_precision():
            ref = leaf_bounds([piece], rows * cols, trusted=True)
            got = fused([piece], rows * cols, GramCache())
        assert fused.compiled  # one graph for every layer shape of this chunk shape
        for name in ("sq", "bound", "slack", "rounding"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-13, atol=0)
        assert torch.equal(got.loose, ref.loose)


def _uncovered():
    gen = torch.Generator().manual_seed(3)
    layer = _layer()
    ids = OuterSum(torch.randint(0, 96, (4, 16), generator=gen), layer.b, rows=96)
    long = OuterSum(torch.randn(4, 64, 8, generator=gen), torch.randn(4, 64, 8, generator=gen))
    dense = Dense(torch.randn(4, 96, 64, generator=gen))
    return {"several pieces": [layer, dense], "ids": [ids], "materialised": [long]}


@pytest.mark.parametrize("case", ["several pieces", "ids", "materialised", "overflow"])
def test_other_leaves_take_the_general_route(case, monkeypatch):
    pieces = _uncovered().get(case)
    if pieces is None:  # squares beyond FLT_MAX: an fp32 Gram (a wide one is fp64) overflows
        big = _layer(steps=64, rows=1100, cols=256)
        assert not wide(big.a)
        pieces = [OuterSum(big.a * 2.0**70, big.b)]
    numel = math.prod(pieces[0].shape)
    fused = LeafBoundsFn(compiled=True)
    with full_precision():
        ref = leaf_bounds(pieces, numel, trusted=True)
        got = fused(pieces, numel, GramCache())
    for name in FIELDS:
        torch.testing.assert_close(
            getattr(got, name), getattr(ref, name), rtol=0, atol=0, equal_nan=True
        )
    if case == "overflow":  # the Gram norm itself overflowed: those examples go the exact route
        assert bool(got.loose.all())


def test_a_failing_compiled_call_falls_back_to_the_eager_arithmetic(caplog):
    fused = LeafBoundsFn(compiled=True)

    def broken(*args):
        raise RuntimeError("recompile limit reached\nmore detail")

    fused._fn = broken
    piece = _layer()
    with caplog.at_level(logging.WARNING, logger="opake.core"), full_precision():
        got = fused([piece], 96 * 64, GramCache())
        ref = leaf_bounds([piece], 96 * 64, trusted=True)
    assert not fused.compiled
    assert "recompile limit reached" in caplog.text
    assert "more detail" not in caplog.text
    for name in FIELDS:
        assert torch.equal(getattr(ref, name), getattr(got, name)), name


def test_the_compiled_recording_compiles_the_bound_arithmetic_too():
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

    model = torch.nn.Linear(4, 3)

    def losses(params, x):
        return torch.func.functional_call(model, params, (x,)).square().sum(dim=-1)

    runner = BookkeepingRunner(
        BatchedLoss(losses, model), argnums=0, batch_argnums=(1,), has_aux=False
    )
    assert not runner.bounds.compiled
    runner.compile_recording()
    assert runner.bounds.compiled


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")
def test_the_compiled_arithmetic_pins_ieee_flags_whatever_the_environment(unsafe_inductor):
    with full_precision():
        fused = LeafBoundsFn(compiled=True)
        fused([_layer()], 96 * 64, GramCache())
    assert fused.compiled
    unsafe_inductor.check()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("cpp.march", "native -ffast-math -ffp-contract=fast"),  # TORCHINDUCTOR_CPP_MARCH
        ("cpp.march", "-Ofast"),
        ("cpp.cxx", (None, "g++ -ffast-math")),  # CXX with flags
        ("aot_inductor.custom_op_libs", ["m -ffast-math"]),  # written as -l{lib}, then split
        ("aot_inductor.compile_wrapper_opt_level", "O1 -ffast-math"),
        ("aot_inductor.compile_wrapper_opt_level", "Ofast"),
    ],
)
def test_compiler_settings_that_add_flags_are_refused(setting, value):
    import torch._inductor.config as inductor

    from opake.core.errors import ConfigurationError

    refused = pytest.raises(ConfigurationError, match="IEEE")
    with inductor.patch({setting: value}), refused:
        LeafBoundsFn(compiled=True)


@pytest.mark.parametrize("march", [None, "", "native", "x86-64-v3", "armv8.6-a+sve"])
def test_architecture_names_pass(march):
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.march": march}):
        assert LeafBoundsFn(compiled=True).compiled
