"""``torch.compile(grad_fn)``: the vmap engine traces into one graph and equals eager.

Compiled and eager calls compute the same certified norms (the compiled graph calls the eager
``dense_sq_norms`` as an opaque operator: bit for bit), the same factors, and the weighted sums
with Inductor's own reduction order (within a few fp32 ulps of eager). The proven clipping
bound does not depend on compilation: the adversarial cases below run compiled and every
example's contribution stays within C. What does not trace is refused with an
``OperationError`` (``fullgraph=True``) or runs eagerly (without it).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import AdaptiveClipping, AutoSClipping, GroupClipping, clipped_grad
from opake.functional import make_functional

# Inductor's CPU backend touches torch.jit internals that warn on torch 2.13
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
EXACT = 1.0 + 1e-12  # the oracle's fp64 rounding of a norm: the bound is proven, not modelled


def _mlp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss_fn(p, x, y):
        return (torch.func.functional_call(net, p, (x[None],))[0, 0] - y) ** 2

    x, y = torch.randn(12, 6) * 3, torch.randn(12)
    return loss_fn, params, x, y


def _close(got, want, *, atol=1e-6):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol)


@pytest.mark.parametrize(
    ("clip", "extra"),
    [
        (1.0, {}),
        (AutoSClipping(1.0, 0.01), {}),
        (0.5, {"microbatch_size": 6, "normalize_by": 12.0}),
    ],
    ids=["fixed", "auto_s", "fixed-microbatched-normalized"],
)
def test_fullgraph_vmap_engine_equals_eager(clip, extra):
    loss_fn, params, x, y = _mlp()
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), engine="vmap", return_aux=True, **extra
    )
    (got, aux), new_state = torch.compile(grad_fn, fullgraph=True)(params, x, y, state=state)
    (want, want_aux), want_state = grad_fn(params, x, y, state=state)
    _close(got, want)
    assert new_state == want_state
    assert got.max_norm == want.max_norm
    assert int(got.batch_size) == int(want.batch_size)
    # the per-leaf certified norms are the eager code's bit for bit; the reported norms sum
    # them over leaves in a compiled (reordered) fp64 reduction
    for field in ("grad_norms", "clipped_grad_norms", "loss_values"):
        torch.testing.assert_close(getattr(aux, field), getattr(want_aux, field), rtol=1e-6, atol=0)
    assert int(aux.nonfinite_count) == int(want_aux.nonfinite_count) == 0


def test_example_mask_and_nonfinite_examples_compiled():
    loss_fn, params, x, y = _mlp()
    x = x.clone()
    x[3] = float("nan")
    mask = torch.ones(12, dtype=torch.bool)
    mask[7] = False
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), engine="vmap", return_aux=True
    )
    compiled = torch.compile(grad_fn, fullgraph=True)
    (got, aux), _ = compiled(params, x, y, state=state, example_mask=mask)
    (want, want_aux), _ = grad_fn(params, x, y, state=state, example_mask=mask)
    _close(got, want)
    assert int(aux.nonfinite_count) == int(want_aux.nonfinite_count) == 1
    assert int(aux.batch_size) == 11


def _bounded(grad_fn, state, args, bound):
    batch = args[1].shape[0]
    for i in range(batch):
        one = testing.contribution(grad_fn, args, state=state, index=i, batch=batch)
        assert all(bool(torch.isfinite(v).all()) for v in one.values())
        assert testing.exact_norm(one) <= bound * EXACT, i


@pytest.mark.parametrize(
    ("examples", "clip", "kind"),
    [
        # huge output gradients (fp32 block norms overflow: the fp64 route), cancellation
        (
            [
                ("repeated", "alternating", 0.0, 19.0, -12.0),
                ("cancelling", "random", 0.0, 0.0, -8.0),
            ],
            1.0,
            "fixed",
        ),
        # tiny inputs whose squares underflow next to huge targets, NaN/Inf, an all-zero example
        (
            [
                ("random", "random", -25.0, 15.0, 0.0),
                ("nonfinite", "random", 0.0, 0.0, 0.0),
                ("zero", "zero", 0.0, 0.0, 0.0),
            ],
            1e-3,
            "auto_s",
        ),
    ],
    ids=["overflow-cancelling", "underflow-nonfinite-zero"],
)
@pytest.mark.parametrize("engine", ["vmap", "bookkeeping"])
def test_proven_clipping_holds_compiled(examples, clip, kind, engine):
    """Adversarial examples (from the clipping-proof tests' patterns) compiled: the vmap
    engine's ``grad_fn`` compiled whole, or the book-keeping engine with its recording compiled
    (``DPTraining(compile=True)``'s route for a full model; after a benign call, which records
    eagerly): each example's contribution alone is within the bound, exactly."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 3)
    fmodel, params = make_functional(layer)
    loss = BatchedLoss(lambda p, x, y: (fmodel(p, x) * y).sum(dim=(1, 2)), fmodel)
    gen = torch.Generator().manual_seed(0)
    x, y = testing.adversarial_batch(
        examples, gen, tokens=False, width=8, steps=5, out_shape=(5, 3)
    )
    state = clip if kind == "fixed" else AutoSClipping(clip, 0.01)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=state, batch_argnums=(1, 2), engine=engine, check_unused=False
    )
    if engine == "vmap":
        _bounded(torch.compile(grad_fn, fullgraph=True), state, (params, x, y), clip)
        return
    grad_fn._bookkeeping.compile_recording()
    grad_fn(params, torch.randn_like(x) * 0.1, torch.randn_like(y) * 0.1, state=state)
    _bounded(grad_fn, state, (params, x, y), clip)
    assert grad_fn._bookkeeping.compiled.calls == x.shape[0]


@pytest.mark.parametrize("clip", [1.0, 0.5])
def test_the_compiled_sum_adds_the_measured_low_precision_gradient(clip):
    """bf16 parameters under Inductor: the per-example gradient ``bf16(x·y)`` rounds down, and
    a sum fused with its producer would recompute it from the fp32 inputs without that rounding
    (1.0034·C was measured so). The compiled sum reads the very buffer the certified norms
    measured: the example's contribution is within C, and equals eager bit for bit."""
    n, xa, ya = 64, 1 + 7 / 128, 1 + 9 / 128  # x·y = 1.12885 rounds down to 1.125 in bf16

    def loss(p, x, y):
        return (p["s"] * x.to(torch.bfloat16)).sum() * y.to(torch.bfloat16)

    params = {"s": torch.zeros(n, dtype=torch.bfloat16)}
    x, y = torch.full((4, n), xa), torch.full((4,), ya)
    mask = torch.tensor([True, False, False, False])
    grad_fn, state = clipped_grad(loss, clipping_norm=clip, batch_argnums=(1, 2), engine="vmap")
    compiled, _ = torch.compile(grad_fn, fullgraph=True, dynamic=False)(
        params, x, y, state=state, example_mask=mask
    )
    eager, _ = grad_fn(params, x, y, state=state, example_mask=mask)
    assert testing.exact_norm(compiled) <= clip
    assert torch.equal(compiled["s"], eager["s"])


_LOW = {}


def _low_precision_step(dtype):
    """One Inductor-compiled ``grad_fn`` over a ``dtype`` Linear (compiled once per dtype)."""
    if dtype not in _LOW:
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 4).to(dtype)
        fmodel, params = make_functional(layer)

        def loss(p, x, y):  # one example: squared error, the attacker picks x and y
            return ((fmodel(p, x[None].to(dtype)) - y.to(dtype)) ** 2).sum()

        grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine="vmap")
        _LOW[dtype] = (torch.compile(grad_fn, fullgraph=True, dynamic=False), state, params)
    return _LOW[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=12, deadline=None)
@given(
    scale=st.sampled_from([2.0**-14, 2.0**-6, 1.0, 2.0**6, 2.0**12]),
    seed=st.integers(0, 2**16),
    rounding=st.sampled_from(["random", "bf16-down"]),
)
def test_low_precision_contributions_are_bounded_compiled(dtype, scale, seed, rounding):
    """Property: with bf16/fp16 parameters under Inductor, no example's contribution (alone,
    by ``example_mask``) exceeds C — over scales from underflow to large, and inputs whose
    low-precision products round systematically — against the exact norm."""
    step, state, params = _low_precision_step(dtype)
    gen = torch.Generator().manual_seed(seed)
    if rounding == "bf16-down":  # products that round down in bf16, every entry alike
        x = torch.full((4, 16), 1 + 7 / 128) * scale
        y = torch.full((4, 4), -(1 + 9 / 128)) * scale
    else:
        x = torch.randn(4, 16, generator=gen) * scale
        y = torch.randn(4, 4, generator=gen) * scale
    dtype_max = torch.finfo(dtype).max
    x, y = x.clamp(-dtype_max, dtype_max), y.clamp(-dtype_max, dtype_max)
    for i in range(4):
        mask = torch.zeros(4, dtype=torch.bool)
        mask[i] = True
        grads, _ = step(params, x, y, state=state, example_mask=mask)
        assert testing.exact_norm(grads) <= 0.5, (i, testing.exact_norm(grads))


def _unsupported():
    return torch._dynamo.exc.Unsupported


def test_units_are_refused_fullgraph_and_run_eagerly_otherwise():
    loss_fn, params, x, y = _mlp()
    units = torch.arange(12) // 3
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), engine="vmap")
    with pytest.raises(_unsupported(), match="privacy units"):
        torch.compile(grad_fn, fullgraph=True)(params, x, y, state=state, units=units)
    torch._dynamo.reset()
    got, _ = torch.compile(grad_fn)(params, x, y, state=state, units=units)
    want, _ = grad_fn(params, x, y, state=state, units=units)
    _close(got, want)


def test_bookkeeping_is_refused_fullgraph_and_runs_eagerly_otherwise():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 2)
    fmodel, params = make_functional(net)
    loss = BatchedLoss(lambda p, x, y: ((fmodel(p, x) - y) ** 2).sum(dim=1), fmodel)
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    with pytest.raises(_unsupported(), match="engine='bookkeeping'"):
        torch.compile(grad_fn, fullgraph=True)(params, x, y, state=state)
    torch._dynamo.reset()
    got, _ = torch.compile(grad_fn)(params, x, y, state=state)
    assert grad_fn.engine == "bookkeeping"
    want, _ = grad_fn(params, x, y, state=state)
    _close(got, want, atol=0.0)


@pytest.mark.parametrize(
    "clip",
    [
        GroupClipping({"0": 0.5, "2": 0.5}),
        AdaptiveClipping(1.0, count_noise_multiplier=1.0, expected_batch_size=12, seed=0),
    ],
    ids=["group", "adaptive"],
)
def test_group_and_adaptive_compile_with_graph_breaks(clip):
    """Not fullgraph (docs/guide/clipping.md): group clipping compiles with a graph break,
    adaptive clipping is refused while tracing and runs eagerly; both equal eager."""
    loss_fn, params, x, y = _mlp()
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=clip, batch_argnums=(1, 2), engine="vmap")
    got, new_state = torch.compile(grad_fn)(params, x, y, state=state)
    want, want_state = grad_fn(params, x, y, state=state)
    _close(got, want)
    assert new_state == want_state


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("OPAKE_TEST_COMPILE_MODELS") != "1",
    reason="opt-in (about 40 s of compilation on a 2-core CPU): OPAKE_TEST_COMPILE_MODELS=1",
)
def test_fullgraph_tiny_llama_equals_eager():
    pytest.importorskip("transformers")
    model = testing.tiny_llama(hidden_size=16, num_hidden_layers=1, intermediate_size=32)
    fmodel, params = make_functional(model)

    def loss_fn(p, ids):
        return fmodel(p, ids[None], labels=ids[None]).loss

    ids = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(0))
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1,), engine="vmap")
    got, _ = torch.compile(grad_fn, fullgraph=True)(params, ids, state=state)
    want, _ = grad_fn(params, ids, state=state)
    _close(got, want, atol=1e-6)


def test_compiled_factors_still_round_toward_zero():
    """The fp32 clip factors round toward zero under Inductor too: the cast round trip
    ``fp64 → fp32 → fp64`` that detects a rounded-up factor must not be folded away (a torch
    release whose Inductor dropped it would let a factor grow by half an ulp, several parts
    per million for a subnormal one)."""
    from opake.dpsgd.certify import ieee_compile_options
    from opake.dpsgd.clipping._base import _fp32_toward_zero

    gen = torch.Generator().manual_seed(11)
    exponents = torch.randint(-148, 2, (4096,), generator=gen).double()
    factor = torch.rand(4096, generator=gen, dtype=torch.float64).add(1.0) * 2.0**exponents
    # half an fp32 ulp and more above fp32 numbers: round to nearest goes up
    base = factor.float()
    above = torch.nextafter(base, torch.full_like(base, 2.0)).double()
    factor = torch.cat([factor, base.double() * 0.25 + above * 0.75]).clamp(max=1.0)
    compiled = torch.compile(
        _fp32_toward_zero, fullgraph=True, dynamic=False, options=ieee_compile_options()
    )
    got = compiled(factor)
    assert bool((got.double() <= factor).all())
    assert torch.equal(got, _fp32_toward_zero(factor))
    assert bool((factor.float().double() > factor).any())  # the cases round up to nearest
