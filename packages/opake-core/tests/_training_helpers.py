"""A tiny classifier, its data and a DPTraining factory shared by the test_training* tests.

The tests load this module by its path (they are imported with ``--import-mode=importlib``, so
a sibling module is not on ``sys.path``); each passes its own settings (N, q, σ, C, δ, seed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from opake.core.testing import tiny_mlp
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples of 8 features (scales 0.2 to 5, so that some are clipped) and 4 classes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=gen) * torch.linspace(0.2, 5.0, n)[:, None]
    y = torch.randint(0, 4, (n,), generator=gen)
    return x, y


def loss(fmodel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The cross-entropy of one example (one record), as ``loss_fn(params, x, y)``."""

    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fmodel(params, x[None]), y[None])

    return loss_fn


def training(
    settings: Mapping[str, Any], model: torch.nn.Module | None = None, *, lr: float
) -> tuple[torch.nn.Module, DPTraining]:
    """``model`` (``tiny_mlp(seed=0)`` if ``None``) and a DPTraining of it: SGD(``lr``), the
    :func:`loss` over ``(x, y)`` batches, ``settings`` the rest of its keyword arguments."""
    model = model if model is not None else tiny_mlp(seed=0)
    fmodel, params = make_functional(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, DPTraining(loss(fmodel), opt, params, module=model, batch_args=2, **settings)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}
