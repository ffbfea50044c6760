"""The book-keeping engine with its batched forward and backward compiled (``compile=True``).

The compiled recording must hand the eager code the same uses (inputs, output gradients,
parameters), so the clipped sums equal the eager engine's; a structure's first call records
eagerly; a model the compiled hooks cannot see (an implicit use) records eagerly for good; a
compiled call that uses other layers than the eager recording is refused; and each example's
contribution stays within C exactly on every rule's adversarial batch, compiled (the proof's
own adversarial cases run compiled in ``test_compile.py``). The models are tiny:
Inductor compiles each in a few seconds on a 2-core CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from opake.core import testing
from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping import BatchedLoss, implicit_use
from opake.dpsgd.clipping import clipped_grad
from opake.dpsgd.sampling import padding_mask
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional

VOCAB, WIDTH, STEPS = 16, 8, 5
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


class _Tiny(torch.nn.Module):
    """Embedding → Linear → LayerNorm → Linear head: four rules, one of them keeping outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.skip = False  # a data-independent branch the compiled-layout check must see

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if not self.skip:
            h = torch.tanh(self.proj(h))
        return self.head(self.norm(h))


def _loss(model: torch.nn.Module) -> tuple[BatchedLoss[torch.Tensor], dict[str, torch.Tensor]]:
    fmodel, params = make_functional(model)

    def losses(p, ids, targets):
        logits = fmodel(p, ids)
        per_token = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, reduction="none"
        )
        return per_token.mean(dim=1)

    return BatchedLoss(losses, fmodel), params


def _batch(seed: int, batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, STEPS), generator=gen)
    return ids, torch.randint(0, VOCAB, (batch, STEPS), generator=gen)


def _grad_fns(model, clip=0.05):
    loss, params = _loss(model)
    options = {"clipping_norm": clip, "batch_argnums": (1, 2), "engine": "bookkeeping"}
    eager, state = clipped_grad(loss, **options)
    compiled, _ = clipped_grad(loss, **options)
    compiled._bookkeeping.compile_recording()
    return eager, compiled, state, params


def test_compiled_recording_equals_eager():
    torch.manual_seed(0)
    eager, compiled, state, params = _grad_fns(_Tiny())
    runner = compiled._bookkeeping
    for seed in range(3):  # the first call records eagerly, the next ones compiled
        ids, targets = _batch(seed)
        want, _ = eager(params, ids, targets, state=state)
        got, _ = compiled(params, ids, targets, state=state)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
    assert runner.compiled is not None
    assert runner.compiled.calls == 2
    assert runner.compiled.eager is None
    assert compiled.engine == "bookkeeping"


def test_a_compiled_call_with_other_layers_is_refused():
    """Dynamo retraces a changed branch; the compiled uses then differ from the eager layout
    of the same shapes, and the call is refused (engine='bookkeeping' is explicit)."""
    torch.manual_seed(0)
    model = _Tiny()
    _, compiled, state, params = _grad_fns(model)
    ids, targets = _batch(0)
    compiled(params, ids, targets, state=state)  # eager: learns the layout
    compiled(params, ids, targets, state=state)  # compiled
    model.skip = True
    with pytest.raises(OperationError, match="other layers"):
        compiled(params, ids, targets, state=state)


class _Scaled(torch.nn.Module):
    """A layer whose forward taps its own parameter (an implicit use)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = implicit_use(self)
        if use is None:
            return x * self.weight
        out = x * use.params["weight"].detach()
        return use.tap(out, lambda g: {"weight": (g * x.detach()).sum(dim=1)}, inside=True)


def test_an_implicit_use_records_eagerly_for_good(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), _Scaled())
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x, y: ((fmodel(p, x) - y) ** 2).sum(dim=(1, 2)), fmodel)
    options = {"clipping_norm": 0.5, "batch_argnums": (1, 2), "engine": "bookkeeping"}
    eager, state = clipped_grad(loss, **options, trusted_rules=("per_layer",))
    compiled, _ = clipped_grad(loss, **options, trusted_rules=("per_layer",))
    compiled._bookkeeping.compile_recording()
    x, y = torch.randn(4, STEPS, WIDTH), torch.randn(4, STEPS, WIDTH)
    with caplog.at_level(logging.WARNING, logger="opake.core"):
        for _ in range(2):
            want, _ = eager(params, x, y, state=state)
            got, _ = compiled(params, x, y, state=state)
            for name, value in want.items():
                torch.testing.assert_close(got[name], value)
    recording = compiled._bookkeeping.compiled
    assert recording.eager is not None
    assert "implicit" in recording.eager
    assert recording.calls == 0
    assert "records eagerly" in caplog.text


def _training(loss, params, compile: bool) -> DPTraining:
    opt = torch.optim.SGD(list(params.values()), lr=0.5)
    return DPTraining(
        loss,
        opt,
        params,
        batch_args=2,
        dataset_size=40,
        expected_batch_size=6.0,
        sampler="fixed",
        max_batch_size=8,
        noise_multiplier=0.8,
        delta=1e-5,
        clipping_norm=0.05,
        microbatch_size=4,
        compile=compile,
        seed=3,
        accountant="rdp",
    )


def test_dp_training_compiles_book_keeping_for_a_full_model(caplog):
    """``DPTraining(compile=True)`` with a ``BatchedLoss`` over a whole model: the book-keeping
    engine with its recording compiled; the steps equal the eager training's (same noise)."""
    ids, targets = _batch(7, batch=40)
    results = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = _Tiny()
        loss, _ = _loss(model)
        params = dict(model.named_parameters())
        training = _training(loss, params, compile)
        drawn = training.batches()
        with caplog.at_level(logging.INFO, logger="opake.core"):
            for _ in range(3):
                indices = next(drawn)
                rows = torch.as_tensor(indices)
                training.step(ids[rows], targets[rows], example_mask=padding_mask(indices))
        results.append({k: v.detach().clone() for k, v in params.items()})
        if compile:
            assert training._compiled.engine == "bookkeeping"
            assert training._grad_fn._bookkeeping.compiled.calls > 0
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, atol=1e-5, rtol=1e-5)
    assert "book-keeping engine, its batched forward and backward compiled" in caplog.text


@pytest.fixture
def compiled_runners(monkeypatch):
    """Every ``clipped_grad`` of the conformance harness records with a compiled forward and
    backward; yields the runners it made."""
    import opake.dpsgd.clipping as clipping

    real = clipping.clipped_grad
    runners = []

    def compiling(*args, **kwargs):
        grad_fn, state = real(*args, **kwargs)
        grad_fn._bookkeeping.compile_recording()
        runners.append(grad_fn._bookkeeping)
        return grad_fn, state

    monkeypatch.setattr(clipping, "clipped_grad", compiling)
    return runners


CASES = testing.rule_example_cases()


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_every_rule_keeps_the_bound_with_a_compiled_recording(name, index, compiled_runners):
    """The conformance harness's checks (each contribution ≤ C exactly, the sum is the sum of
    the contributions) on an adversarial batch, the contributions recorded compiled (the
    harness's first, whole-batch call records eagerly)."""
    attack = [
        ("random", "random", 0.0, 0.0, 0.0),
        ("repeated", "alternating", 0.0, 15.0, -12.0),
        ("cancelling", "random", 0.0, 0.0, -8.0),
    ]
    assert testing.check_rule_example(name, index, attack, 1.0, 0) <= 1.0 + 1e-12
    (runner,) = compiled_runners
    recording = runner.compiled
    assert recording.calls == len(attack) or recording.eager is not None, recording.eager


def test_a_deep_copy_made_after_the_hooks_records_nothing():
    """A reference model copied from the trained one after its hooks were installed (e.g. a
    frozen teacher) carries the hooks along; they record only the module they were made for."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
    fmodel, params = make_functional(model)
    teachers: list[torch.nn.Module] = []

    def losses(p, x, y):
        out = fmodel(p, x)
        if teachers:
            with torch.no_grad():
                y = y + teachers[0](x)
        return ((out - y) ** 2).sum(dim=(1, 2))

    options = {"clipping_norm": 0.5, "batch_argnums": (1, 2), "engine": "bookkeeping"}
    grad_fn, state = clipped_grad(BatchedLoss(losses, fmodel), **options)
    grad_fn._bookkeeping.compile_recording()
    x, y = torch.randn(4, STEPS, WIDTH), torch.randn(4, STEPS, WIDTH)
    for _ in range(2):
        grad_fn(params, x, y, state=state)
    teachers.append(copy.deepcopy(model))
    got, _ = grad_fn(params, x, y, state=state)
    eager, _ = clipped_grad(BatchedLoss(losses, fmodel), **options)
    want, _ = eager(params, x, y, state=state)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
    recording = grad_fn._bookkeeping.compiled
    assert recording.calls == 2
    assert grad_fn._bookkeeping.disabled is None
