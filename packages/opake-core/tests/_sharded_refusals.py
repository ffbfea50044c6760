"""The refusals of level 2, run by ``_sharded_worker.py basic`` on each rank (2 gloo ranks).

What mixes examples (a batch mean, a Linear run with the batch dimension moved, batch
statistics), a parameter read outside its layer (an output head on the embedding's weight),
ranks whose calls do not line up, a rank that steps while another runs one more physical
batch, and a parameter trainable on one rank only: each case records, per rank, the error it
raised (``"TypeName: message"``) or ``"accepted"``; every rank must raise the same type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class MixMean(torch.nn.Module):
    """Parameter-free, and it mixes the examples: every row moves with the batch mean."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 3.0 * h.mean(0, keepdim=True)


class FunctionalBatchNorm(torch.nn.Module):
    """Batch statistics without a ``_BatchNorm`` module."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.batch_norm(h, None, None, training=True)


class Net(torch.nn.Module):
    """Linear → ``mix`` → tanh → Linear (one FSDP unit) → head; ``moved``: the unit runs on
    ``[T, B, d]`` (its rows are time steps, not examples)."""

    def __init__(self, mix: torch.nn.Module | None = None, moved: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 6)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(6, 6), mix or torch.nn.Identity(), torch.nn.Tanh()
        )
        self.head = torch.nn.Linear(6, 3)
        self.moved = moved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.moved:  # x [B, T, 4]
            return self.head(self.block(h.transpose(0, 1)).transpose(0, 1).mean(1))
        return self.head(self.block(h))


class TiedHead(torch.nn.Module):
    """Embedding → Linear, tanh (one FSDP unit) → mean over the tokens → logits on the
    embedding's weight. ``module=True``: an ``nn.Linear`` head tied to it (a layer the engine
    records); otherwise ``F.linear(h, self.embed.weight)``, a use of the weight outside its
    layer that no rule records (the head's share of its gradient would be lost)."""

    def __init__(self, module: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(5, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
        self.head = torch.nn.Linear(6, 5, bias=False) if module else None
        if self.head is not None:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(ids)).mean(1)
        if self.head is not None:
            return self.head(h)
        return torch.nn.functional.linear(h, self.embed.weight)


def _outcome(run: Callable[..., object], *args: Any, **kwargs: Any) -> str:
    try:
        run(*args, **kwargs)
    except Exception as err:  # what each rank raised, compared across ranks by the test
        return f"{type(err).__name__}: {err}"
    return "accepted"


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """Each case on this rank: the error it raised, or ``"accepted"``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad

    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)

    def build(net: Any, **options: Any) -> tuple[Any, Any, Any]:
        fully_shard(net.block, mesh=mesh)
        fully_shard(net, mesh=mesh)

        def losses(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(net(x), y, reduction="none")

        grad_fn, state = sharded_clipped_grad(
            losses, net, clipping_norm=1.0, batch_argnums=(0, 1), **options
        )
        return net, grad_fn, state

    out: dict[str, str] = {}
    for name, mix in (("mix", MixMean()), ("functional_bn", FunctionalBatchNorm())):
        _, grad_fn, state = build(Net(mix))
        out[name] = _outcome(grad_fn, x, y, state=state)
        out[f"{name}_again"] = _outcome(grad_fn, x, y, state=state)
    ids = torch.randint(0, 5, (4, 3), generator=gen)
    _, grad_fn, state = build(TiedHead(module=False))
    out["tied_functional"] = _outcome(grad_fn, ids, y, state=state)
    out["tied_functional_again"] = _outcome(grad_fn, ids, y, state=state)
    net, grad_fn, state = build(TiedHead(module=True))
    with torch.no_grad():  # an evaluation first: FSDP leaves the root unit gathered
        net(ids)
    out["tied_module"] = _outcome(grad_fn, ids, y, state=state)
    _, grad_fn, state = build(Net(moved=True))
    out["moved"] = _outcome(grad_fn, torch.randn(4, 4, 4, generator=gen), y, state=state)
    no_stats = torch.nn.BatchNorm1d(6, affine=False, track_running_stats=False)
    out["bn_no_stats"] = _outcome(build, Net(no_stats).eval())
    net, grad_fn, state = build(Net(torch.nn.BatchNorm1d(6, affine=False)).eval())
    out["bn_eval"] = _outcome(grad_fn, x, y, state=state)
    net.train()  # after a first call in eval mode
    out["bn_train"] = _outcome(grad_fn, x, y, state=state)
    _, grad_fn, state = build(Net(), microbatch_size=1 + rank)
    out["microbatch"] = _outcome(grad_fn, x, y, state=state)
    _, grad_fn, state = build(Net())
    out["end_step"] = _outcome(grad_fn, x, y, state=state, end_step=rank == 1)
    out["plain"] = _outcome(grad_fn, x, y, state=state)
    net, grad_fn, state = build(Net())
    opt = ShardedDPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        net,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        seed=0,
    )

    def step(batches: int) -> None:
        for _ in range(batches):
            grads, _ = grad_fn(x, y, state=state)
            opt.accumulate(grads)
        opt.step()

    # rank 1 runs one more physical batch: its 2nd call meets rank 0's step (no hang)
    out["out_of_step"] = _outcome(step, 1 + rank)
    opt.zero_grad()  # the step is dropped on every rank; the ranks are in line again
    out["in_step_again"] = _outcome(step, 2)
    # the optimizer's own logical_step runs the level-2 grad_fn without params
    out["logical_step"] = _outcome(
        lambda: opt.logical_step(grad_fn, None, [(x, y), (x[:2], y[:2])], state=state)
    )
    # a parameter trainable on one rank only: the ranks would reduce different sums
    net, grad_fn, state = build(Net())
    net.head.bias.requires_grad_(rank == 0)
    out["names_differ"] = _outcome(grad_fn, x, y, state=state)
    return out
