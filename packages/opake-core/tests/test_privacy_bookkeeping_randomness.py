"""Book-keeping never runs without its per-example check (red-team finding, round 4).

The check compares one example's book-keeping gradient with that example's own autograd
gradient: it is what keeps a ``BatchedLoss`` that mixes examples out. With random layers
(``randomness`` other than ``"error"``) it cannot run, and an explicit ``engine="bookkeeping"``
used to go on without it, silently: a loss whose entries read the batch's mean label moved the
clipped sum by 3·C. It is refused now, as the guide says; ``"auto"`` takes the vmap engine.
"""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional


def _mixing_loss() -> tuple[BatchedLoss, dict[str, torch.Tensor]]:
    lin = torch.nn.Linear(4, 1, bias=False)
    fmodel, params = make_functional(lin)

    def losses(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fmodel(p, x)[:, 0] * (1.0 + 100.0 * y.mean())  # every entry reads the batch

    return BatchedLoss(losses, lin), {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_explicit_bookkeeping_with_random_layers_is_refused(randomness: str) -> None:
    loss, params = _mixing_loss()
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping", randomness=randomness
    )
    x, y = torch.eye(4)[:2], torch.tensor([-3.0, 1.0])
    with pytest.raises(ConfigurationError, match=r"randomness=.*per-example check cannot run"):
        grad_fn(params, x, y, state=state)


def test_auto_with_random_layers_takes_the_vmap_engine() -> None:
    lin = torch.nn.Linear(4, 1)
    fmodel, params = make_functional(lin)
    loss = BatchedLoss(lambda p, x: fmodel(p, x)[:, 0] ** 2, lin)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=1, randomness="different")
    grad_fn({k: v.detach() for k, v in params.items()}, torch.randn(3, 4), state=state)
    assert grad_fn.engine == "vmap"
