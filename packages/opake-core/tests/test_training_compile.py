"""DPTraining(compile=True): the compiled step equals the eager one; padding adds nothing.

Compilation is slow on CPU, so most tests trace with Dynamo's ``eager`` backend (the chunking,
padding, masking and merging are what they check); one test compiles with Inductor.
"""

from __future__ import annotations

import functools

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.core.testing import tiny_mlp
from opake.dpsgd.clipping import AdaptiveClipping, AutoSClipping
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional

N, C = 40, 0.5
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


@pytest.fixture
def eager_backend(monkeypatch):
    """``torch.compile`` with Dynamo's ``eager`` backend (tracing without Inductor)."""
    stock = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(stock, backend="eager"))


def _data():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(N, 8, generator=gen) * torch.linspace(0.1, 6.0, N)[:, None]
    return x, torch.randint(0, 4, (N,), generator=gen)


def _training(**options):
    model = tiny_mlp(in_features=8, hidden=16, classes=4, seed=0)
    fmodel, params = make_functional(model)

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(fmodel(p, x[None]), y[None])

    settings = {
        "batch_args": 2,
        "dataset_size": N,
        "expected_batch_size": 9.0,
        "noise_multiplier": 0.8,
        "delta": 1e-5,
        "clipping_norm": C,
        "seed": 3,
        "accountant": "rdp",
        **options,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    return model, DPTraining(loss_fn, optimizer, params, **settings)


def _compiled_with(loss_fn, model, params):
    """A compiled training of ``loss_fn`` (chunks of 4 rows)."""
    return DPTraining(
        loss_fn,
        torch.optim.SGD(model.parameters(), lr=0.1),
        params,
        batch_args=2,
        dataset_size=N,
        expected_batch_size=8.0,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        microbatch_size=4,
        compile=True,
    )


def _accumulated(training):
    """The clipped sum the DP optimizer holds for the pending step (before noise)."""
    return {k: v.detach().clone() for k, v in training._optimizer._sums.items()}


def _run(steps, **options):
    x, y = _data()
    model, training = _training(**options)
    results = []
    for _, idx in zip(range(steps), training.batches(), strict=False):
        rows = torch.tensor(idx, dtype=torch.long)
        mask = None
        if options.get("sampler") == "fixed":
            from opake.dpsgd.sampling import padding_mask

            mask = padding_mask(idx)
            rows = rows.clamp(min=0)
        results.append(training.step(x[rows], y[rows], example_mask=mask))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, results


@pytest.mark.parametrize(
    "options",
    [
        {"microbatch_size": 4},
        {"microbatch_size": 3, "clipping_norm": AutoSClipping(C)},
        {"sampler": "fixed", "max_batch_size": 16},
    ],
    ids=["poisson-chunks", "auto-s", "fixed"],
)
def test_compiled_training_equals_eager(eager_backend, options):
    eager, eager_results = _run(4, **options)
    compiled, results = _run(4, compile=True, **options)
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, atol=1e-5, rtol=1e-5)
    for a, b in zip(results, eager_results, strict=True):
        assert (a.batch_size, a.clipped) == (b.batch_size, b.clipped)
        assert a.loss == pytest.approx(b.loss, rel=1e-5, nan_ok=True)


def test_padding_rows_add_exactly_nothing(eager_backend):
    """A batch of 5 runs as chunks of 4 with 3 padded rows repeating row 0 — an example made
    to have a huge gradient: its copies are masked, so the sum is the eager sum of 5."""
    x, y = _data()
    x = x[:5].clone()
    x[0] *= 1e4
    y = y[:5]
    _, eager = _training(microbatch_size=4)
    _, compiled = _training(microbatch_size=4, compile=True)
    assert compiled.compiled
    assert not eager.compiled
    want = eager.accumulate(x, y)
    got = compiled.accumulate(x, y)
    sums = [_accumulated(t) for t in (eager, compiled)]
    for name, value in sums[0].items():
        torch.testing.assert_close(sums[1][name], value, atol=1e-6, rtol=1e-6)
    assert int(got.batch_size) == int(want.batch_size) == 5
    assert got.loss_values.shape == want.loss_values.shape == (5,)
    torch.testing.assert_close(got.grad_norms, want.grad_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.clipping_rate, want.clipping_rate)


def test_an_empty_batch_contributes_zeros(eager_backend):
    _, training = _training(microbatch_size=4, compile=True)
    aux = training.accumulate(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert int(aux.batch_size) == 0
    assert aux.loss_values.shape == (0,)
    assert all(float(v.abs().max()) == 0.0 for v in _accumulated(training).values())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"privacy_units": list(range(N)), "microbatch_size": 4}, "privacy_units"),
        (
            {
                "clipping_norm": AdaptiveClipping(
                    C, count_noise_multiplier=5.0, expected_batch_size=9.0
                ),
                "microbatch_size": 4,
            },
            "AdaptiveClipping",
        ),
        ({}, "microbatch_size"),
    ],
    ids=["units", "adaptive", "poisson-without-chunks"],
)
def test_what_cannot_compile_is_refused_at_construction(options, match):
    with pytest.raises(ConfigurationError, match=match):
        _training(compile=True, **options)


def test_compile_takes_a_bool():
    with pytest.raises(InputTypeError, match="compile"):
        _training(compile="yes", microbatch_size=4)


def test_a_loss_that_does_not_trace_is_an_opake_error(eager_backend):
    model = tiny_mlp(in_features=8, hidden=16, classes=4, seed=0)
    fmodel, params = make_functional(model)

    def loss_fn(p, x, y):
        loss = torch.nn.functional.cross_entropy(fmodel(p, x[None]), y[None])
        if float(loss) > 0:  # a host sync: not traceable under vmap
            return loss
        return -loss

    training = _compiled_with(loss_fn, model, params)
    x, y = _data()
    with pytest.raises(OperationError, match="compile=True"):
        training.step(x[:6], y[:6])
    assert training.steps == 0


def test_inductor_compiled_step_equals_eager(unsafe_inductor):
    """Compiled with Inductor, whatever unsafe math or contraction the environment asks for:
    the compiled clipped-gradient call pins IEEE flags (``ieee_compile_options``)."""
    eager, _ = _run(2, microbatch_size=8)
    compiled, _ = _run(2, microbatch_size=8, compile=True)
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, atol=1e-5, rtol=1e-5)
    unsafe_inductor.check()


def test_units_per_call_are_refused_compiled(eager_backend):
    """``accumulate(units=)`` without ``privacy_units``: the compiled chunks would clip a unit's
    rows apart (sensitivity 2·C for a unit of two rows), so it is refused, nothing pending."""
    x, y = _data()
    _, training = _training(microbatch_size=4, compile=True)
    first, second = training.sampler.batch_at(0)[:2]
    records = [first, first, second, second]  # two drawn examples, two rows each
    with pytest.raises(ConfigurationError, match="compile=False"):
        training.accumulate(
            x[records], y[records], units=torch.tensor([0, 0, 1, 1]), records=records
        )
    assert training.pending_batches == 0


def test_pending_batches_counts_physical_batches_not_chunks(eager_backend):
    x, y = _data()
    _, training = _training(microbatch_size=2, compile=True)
    training.accumulate(x[:5], y[:5])  # three chunks
    assert training.pending_batches == 1
    result = training.finish_step()
    assert result.batch_size == 5
    assert len(result.aux) == 1


def test_a_bad_mask_is_refused_before_anything_is_noised(eager_backend):
    """The mask is checked as eagerly (bool, one entry per row): a longer one used to pass the
    compiled chunks and fail after the noise and the accounting."""
    x, y = _data()
    _, training = _training(microbatch_size=4, compile=True)
    for mask in (torch.ones(8, dtype=torch.bool), torch.arange(5), torch.ones(5)):
        with pytest.raises(InputTypeError, match="example_mask"):
            training.step(x[:5], y[:5], example_mask=mask)
    assert (training.steps, training.pending_batches) == (0, 0)


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "4"])
def test_the_chunk_size_is_checked_at_construction(size):
    with pytest.raises((ConfigurationError, InputTypeError), match="microbatch_size"):
        _training(compile=True, microbatch_size=size)


def test_shapes_past_the_recompile_limit_say_to_pad(eager_backend):
    """Each new sequence length compiles again; past torch's limit the error says to pad."""
    with torch._dynamo.config.patch(recompile_limit=2):  # torch's own, restored after
        _past_the_recompile_limit()


def _past_the_recompile_limit():
    model = tiny_mlp(in_features=8, hidden=16, classes=4, seed=0)
    fmodel, params = make_functional(model)

    def loss_fn(p, x, y):  # x [T, 8]: a variable-length example
        return torch.nn.functional.cross_entropy(fmodel(p, x), y.expand(x.shape[0]))

    training = _compiled_with(loss_fn, model, params)
    y = torch.zeros(4, dtype=torch.long)
    for length in (1, 2):  # within the limit
        training.step(torch.randn(4, length, 8), y)
    with pytest.raises(OperationError, match="pad every batch"):
        training.step(torch.randn(4, 3, 8), y)


def test_a_compiler_that_adds_flags_is_refused_before_anything_is_noised():
    # TORCHINDUCTOR_CPP_MARCH="native -ffast-math" put -ffinite-math-only into the compiled
    # step: its non-finite checks vanished and a NaN reached the clipped sum
    import torch._inductor.config as inductor

    x, y = _data()
    _, training = _training(microbatch_size=8, compile=True)
    unsafe = inductor.patch({"cpp.march": "native -ffast-math"})
    with unsafe, pytest.raises(ConfigurationError, match="TORCHINDUCTOR_CPP_MARCH"):
        training.step(x[:5], y[:5])
    assert training.steps == 0
    assert training.epsilon() == 0.0
