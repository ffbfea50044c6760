"""Book-keeping's check against per-example autograd runs again whenever what it covered changes.

The check keeps out a model or loss that mixes examples (the bound proof assumes each
example's pieces depend on that example only). It ran once per structure, then every
``RECHECK_EVERY`` calls, and its key held only dtypes, shapes and the layer order. Red-team
round 19 mixed examples after the check, unchecked for up to 63 calls:

- a model in ``eval()`` when checked, then ``train()`` (a frozen ``BatchNorm`` then normalises
  over the batch): one example moved the sum by 3.6·C eager, 4.5·C compiled;
- a Python flag passed to the loss (a non-batched argument) that turns on a batch statistic:
  1.8·C eager, 2.9·C compiled;
- a compiled recording whose trace differs from the eager one that was checked (a
  ``torch.compiler.is_compiling()`` branch): 6.2·C.

Each case now fails the check on the first call after the change (``BookkeepingMismatchError``:
book-keeping is off for good), before anything is summed; the same calls without the change
pass.
"""

from __future__ import annotations

import pytest
import torch

from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.bookkeeping._check import BookkeepingMismatchError
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

B, T, C = 8, 5, 0.01
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(B, T, 8, generator=gen), torch.randn(B, T, 3, generator=gen)
    x[3] = 1e3 * torch.randn(T, 8, generator=gen)  # the example that would dominate a mean
    return x, y


def _checked(loss: BatchedLoss, *, compiled: bool):
    grad_fn, state = clipped_grad(
        loss, clipping_norm=C, batch_argnums=(1, 2), engine="bookkeeping", check_unused=False
    )
    if compiled:
        grad_fn._bookkeeping.compile_recording()
    return grad_fn, state


def _grad_fn(model: torch.nn.Module, *, compiled: bool):
    fmodel, params = make_functional(model)

    def squared(p, x, y):
        return ((fmodel(p, x) - y) ** 2).sum(dim=(1, 2))

    grad_fn, state = _checked(BatchedLoss(squared, fmodel), compiled=compiled)
    return grad_fn, state, params


class _FrozenNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8, affine=False)  # no parameter: no rule sees it
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.a(x).transpose(1, 2)).transpose(1, 2)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_train_mode_after_the_check_is_checked_again(compiled):
    torch.manual_seed(0)
    model = _FrozenNorm().eval()
    grad_fn, state, params = _grad_fn(model, compiled=compiled)
    x, y = _batch()
    for _ in range(3):  # checked in eval mode (compiled: the eager and the compiled call)
        grad_fn(params, x, y, state=state)
    model.train()
    with pytest.raises(BookkeepingMismatchError):
        grad_fn(params, x, y, state=state)
    assert grad_fn._bookkeeping.disabled is not None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_changed_loss_argument_is_checked_again(compiled):
    def centred(fmodel):
        def losses(p, x, y, centre):
            out = fmodel(p, x)
            if centre:  # a batch statistic, only with this setting
                y = y + 50 * out.mean(dim=0, keepdim=True)
            return ((out - y) ** 2).sum(dim=(1, 2))

        return losses

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fmodel, params = make_functional(model)
    grad_fn, state = _checked(BatchedLoss(centred(fmodel), fmodel), compiled=compiled)
    x, y = _batch()
    for _ in range(3):
        grad_fn(params, x, y, False, state=state)
    with pytest.raises(BookkeepingMismatchError):
        grad_fn(params, x, y, True, state=state)


class _CompiledOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.compiler.is_compiling():  # a path only the compiled trace takes
            h = h - h.mean(dim=(0, 1), keepdim=True)
        return self.b(torch.tanh(h))


def test_the_first_compiled_call_is_checked():
    torch.manual_seed(0)
    grad_fn, state, params = _grad_fn(_CompiledOnly(), compiled=True)
    x, y = _batch()
    grad_fn(params, x, y, state=state)  # eager recording: checked, and it passes
    with pytest.raises(BookkeepingMismatchError):
        grad_fn(params, x, y, state=state)  # the compiled trace centres over the batch
    assert grad_fn._bookkeeping.compiled.calls == 1


def test_unchanged_calls_are_not_checked_again(monkeypatch):
    """The recheck is keyed, not every call: the same structure and settings skip it (and a
    compiled call that reuses its graph is not fresh)."""
    from opake.dpsgd.bookkeeping import _runner

    torch.manual_seed(0)
    grad_fn, state, params = _grad_fn(_FrozenNorm().eval(), compiled=True)
    x, y = _batch()
    checks = []
    real = _runner.BookkeepingRunner.verify

    def counted(self, *args, **kwargs):
        checks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_runner.BookkeepingRunner, "verify", counted)
    for _ in range(4):
        grad_fn(params, x, y, state=state)
    recording = grad_fn._bookkeeping.compiled
    assert recording.calls == 3
    assert not recording.fresh
    assert 2 <= len(checks) <= 6  # the eager and the first compiled call (≤ 3 examples each)


def _centring_model() -> torch.nn.Module:
    class Centring(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 3)
            self.centre = False  # a public setting on the model, off when checked

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.centre:
                h = h - h.mean(dim=(0, 1), keepdim=True)
            return self.b(torch.tanh(h))

    return Centring()


def test_a_changed_module_attribute_is_checked_again():
    """Round 20: eager, a flag set on the model after the check (7.9·C unchecked)."""
    torch.manual_seed(0)
    model = _centring_model()
    grad_fn, state, params = _grad_fn(model, compiled=False)
    x, y = _batch()
    for _ in range(2):
        grad_fn(params, x, y, state=state)
    model.centre = True
    with pytest.raises(BookkeepingMismatchError):
        grad_fn(params, x, y, state=state)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_changed_scalar_tensor_setting_is_checked_again(compiled):
    """Round 20: a setting held in a small tensor was keyed by its shape only (6.9·C)."""

    def gated(fmodel):
        def losses(p, x, y, lam):
            out = fmodel(p, x)
            return ((out - y - lam * out.mean(dim=0, keepdim=True)) ** 2).sum(dim=(1, 2))

        return losses

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fmodel, params = make_functional(model)
    grad_fn, state = _checked(BatchedLoss(gated(fmodel), fmodel), compiled=compiled)
    x, y = _batch()
    for _ in range(3):
        grad_fn(params, x, y, torch.zeros(()), state=state)
    with pytest.raises(BookkeepingMismatchError):
        grad_fn(params, x, y, torch.tensor(50.0), state=state)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixing_that_keeps_every_norm_is_caught(compiled):
    """Round 20: one sign for the whole batch, set by its largest row, turns the other
    examples' gradients without changing any norm; the check compared norms only and passed
    (a canary then moved the sum by 15.5·C). It now compares the gradient vectors too."""

    def signed(fmodel):
        def losses(p, x, y):
            s = torch.sign(x[:, 0, 0].sum()).detach()
            return (s * fmodel(p, x) * y).sum(dim=(1, 2))

        return losses

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fmodel, params = make_functional(model)
    grad_fn, state = _checked(BatchedLoss(signed(fmodel), fmodel), compiled=compiled)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, T, 8, generator=gen), torch.randn(B, T, 3, generator=gen)
    x[:, 0, 0] = -1.0
    x[0, 0, 0] = 100.0  # the batch's sign is row 0's; every other row alone has the other
    with pytest.raises(BookkeepingMismatchError, match="away from per-example autograd"):
        grad_fn(params, x, y, state=state)
