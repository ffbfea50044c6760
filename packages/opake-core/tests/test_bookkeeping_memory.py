"""Book-keeping engine memory: what the recording holds is released as the clipped sum runs."""

from __future__ import annotations

import weakref

import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.bookkeeping._pieces import OuterSum
from opake.dpsgd.clipping import clipped_grad
from opake.dpsgd.clipping._choice import prepare
from opake.functional import make_functional

F = torch.nn.functional


class _Spy(dict):  # type: ignore[type-arg]
    """Sums that note, as each leaf's sum is requested, which recorded tensors are alive."""

    def __init__(self, sums: dict[str, torch.Tensor], alive: dict[str, weakref.ref]) -> None:
        super().__init__(sums)
        self.alive = alive
        self.seen: list[tuple[str, set[str]]] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        live = {leaf for leaf, ref in self.alive.items() if ref() is not None}
        self.seen.append((name, live))
        return super().__getitem__(name)


def _chunk(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)

    def losses(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    _, runner = prepare(
        BatchedLoss(losses, fmodel),
        "bookkeeping",
        argnums=0,
        batch_argnums=(1, 2),
        has_aux=False,
    )
    assert runner is not None
    args = (params, *mlp_batch)
    return runner.run(args, len(mlp_batch[0])), params


def test_recorded_tensors_released_after_their_sum_last_layer_first(mlp, mlp_batch):
    chunk, params = _chunk(mlp, mlp_batch)
    names = tuple(params)
    # the output gradient each linear weight's piece recorded: only the chunk holds it
    alive = {}
    for name in names:
        (piece,) = chunk.pieces[name]
        if isinstance(piece, OuterSum):
            alive[name] = weakref.ref(piece.a)
        del piece
    assert len(alive) == 2
    batch = len(mlp_batch[0])
    sums = _Spy({n: torch.zeros(v.shape) for n, v in params.items()}, alive)
    factor = torch.full((batch, len(names)), 0.5, dtype=torch.float64)
    chunk.accumulate(names, factor, torch.ones(batch, dtype=torch.bool), sums)
    order = [name for name, _ in sums.seen]
    assert order == list(reversed(names))  # the last layer's leaves first
    first, last = [n for n in names if n in alive]
    live_at = dict(sums.seen)
    # the last layer's recording is gone before the first layer's sum starts ...
    assert live_at[last] == {first, last}
    assert live_at[first] == {first}
    # ... and nothing the recording held outlives the sum
    assert all(ref() is None for ref in alive.values())
    assert chunk.pieces == {}


def test_norm_pieces_built_in_the_backward_release_the_recording(mlp_batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )
    seen = {}

    def keep_ref(module, args):
        seen["input"] = weakref.ref(args[0])

    model[1].register_forward_pre_hook(keep_ref)
    fmodel, params = make_functional(model)

    def losses(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    _, runner = prepare(
        BatchedLoss(losses, fmodel), "bookkeeping", argnums=0, batch_argnums=(1, 2), has_aux=False
    )
    assert runner is not None
    args = (params, *mlp_batch)
    _, _, uses = runner._forward_backward(args, len(mlp_batch[0]))
    (norm,) = [use for use in uses if use.layer.rule == "layer_norm"]
    # the norm's pieces exist; its input, output and output gradient are gone already
    assert norm.built is not None
    assert {name for name, _ in norm.built} == {"1.weight", "1.bias"}
    assert norm.grad is None
    assert norm.output is None
    assert norm.args == ()
    assert norm.grad_dtype == torch.float32
    assert seen["input"]() is None
    # a linear use keeps its recording for the clipped sum
    assert all(use.grad is not None for use in uses if use.layer.rule == "linear")
    # and the result equals the per-example loop
    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel), clipping_norm=0.5, batch_argnums=(1, 2), engine="bookkeeping"
    )
    got, _ = grad_fn(*args, state=state)
    one = BatchedLoss(losses, fmodel).per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, _ = testing.per_example_grads_loop(one, args, batch_argnums=(1, 2))
    want = testing.reference_clipped_sum(per_example, clipping_norm=0.5)
    testing.assert_grads_close(got, want, rtol=1e-5)


def test_sum_buffers_are_allocated_at_their_first_add_not_before_the_backward(
    mlp, mlp_batch, monkeypatch
):
    from opake.dpsgd.clipping import _bookkeeping

    fmodel, params = make_functional(mlp)

    def losses(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    held_at_accumulate = []
    accumulate = _bookkeeping.BookkeepingEngine.accumulate

    def watching(self, out, factors, sums):
        held_at_accumulate.append(len(sums))
        return accumulate(self, out, factors, sums)

    monkeypatch.setattr(_bookkeeping.BookkeepingEngine, "accumulate", watching)
    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=0.5,
        batch_argnums=(1, 2),
        engine="bookkeeping",
        microbatch_size=4,
    )
    args = (params, *mlp_batch)
    got, _ = grad_fn(*args, state=state)
    # no sum buffer exists through the first chunk's forward and backward; later chunks add
    # into the buffers the first one allocated
    assert held_at_accumulate == [0, len(params), len(params)]
    assert list(got) == list(params)  # the leaves' order
    one = BatchedLoss(losses, fmodel).per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, _ = testing.per_example_grads_loop(one, args, batch_argnums=(1, 2))
    want = testing.reference_clipped_sum(per_example, clipping_norm=0.5)
    testing.assert_grads_close(got, want, rtol=1e-5)
