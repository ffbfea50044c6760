"""Level 2 with ``grad_fn(..., reduce_scatter=True)``, run by ``_sharded_worker.py basic``.

Each logical step is one physical batch (the rank's whole Poisson shard). Three runs of the
worker's tiny Llama, same seeds: the step's reduce-scatter in ``ShardedDPOptimizer.step`` (the
path of several physical batches), and ``reduce_scatter=True`` with one chunk per call and
with microbatches of 2. Each records its parameters, where the reductions ran, and the most
full-size clipped sums alive at once on the rank (every sum the engine allocates is tracked:
alive while its storage holds memory).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import torch


class Alive:
    """The full-size sums the engine allocated (``LazySums``), and the most alive at once."""

    def __init__(self) -> None:
        from opake.dpsgd.clipping._chunks import LazySums

        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.most = 0
        missing = LazySums.__missing__

        def tracked(sums: LazySums, name: str) -> torch.Tensor:
            value = missing(sums, name)
            self.refs.append(weakref.ref(value))
            self.most = max(self.most, self.count())
            return value

        LazySums.__missing__ = tracked  # type: ignore[method-assign]
        self._undo = lambda: setattr(LazySums, "__missing__", missing)

    def count(self) -> int:
        alive = [ref() for ref in self.refs]
        return sum(1 for t in alive if t is not None and t.untyped_storage().nbytes() > 0)

    def close(self) -> None:
        self._undo()


def one_batch_steps(
    W: ModuleType, rank: int, world_size: int, *, scatter: bool, microbatch: int | None
) -> dict[str, Any]:
    """W.STEPS logical steps of one physical batch each; the run's record."""
    import opake.dpsgd.distributed.sharded._grad_fn as grad_fn_module
    from opake.accounting import RDPAccountant
    from opake.dpsgd.distributed import (
        ShardedDPOptimizer,
        gather_full_params,
        sharded_clipped_grad,
    )
    from opake.dpsgd.sampling import PoissonSampler

    ids = W.data()
    model = W.make_model()
    W.shard(model, world_size)
    sampler = PoissonSampler(W.N, W.Q, seed=W.SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = ShardedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=W.LR),
        model,
        sampler=sampler,
        accountant=RDPAccountant(),
        delta=1e-5,
        noise_multiplier=W.SIGMA,
        seed=W.NOISE_SEED,
    )
    grad_fn, state = sharded_clipped_grad(
        W.losses_of(model), model, clipping_norm=W.CLIP, microbatch_size=microbatch
    )
    where = {"optimizer": 0, "grad_fn": 0}
    in_step, in_call = opt._reduce_scatter, grad_fn_module.reduce_rows

    def counted(place: str, inner: Any) -> Any:
        def reduce(*args: Any, **kwargs: Any) -> Any:
            where[place] += 1
            return inner(*args, **kwargs)

        return reduce

    opt._reduce_scatter = counted("optimizer", in_step)
    grad_fn_module.reduce_rows = counted("grad_fn", in_call)  # type: ignore[attr-defined]
    alive = Alive()
    kinds = set()
    try:
        for _, idx in zip(range(W.STEPS), sampler, strict=False):
            batch = ids[torch.tensor(idx, dtype=torch.long)]
            grads, state = grad_fn(batch, state=state, reduce_scatter=scatter)
            kinds.add(type(grads).__name__)
            opt.accumulate(grads)
            del grads
            opt.step()
    finally:
        grad_fn_module.reduce_rows = in_call  # type: ignore[attr-defined]
        alive.close()
    return {
        "params": {n: t.clone() for n, t in gather_full_params(model).items()},
        "reductions": where,
        "most_alive": alive.most,
        "kinds": sorted(kinds),
        "n_params": len(list(model.parameters())),
    }


def misuse(W: ModuleType, world_size: int) -> dict[str, str]:
    """What ``reduce_scatter=True`` refuses: a call after ``end_step=False`` (every rank,
    after the line-up), and mixing its result with another physical batch in one step."""
    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad

    model = W.make_model()
    W.shard(model, world_size)
    opt = ShardedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=W.LR),
        model,
        noise_multiplier=W.SIGMA,
        expected_batch_size=4.0,
        seed=W.NOISE_SEED,
    )
    grad_fn, state = sharded_clipped_grad(W.losses_of(model), model, clipping_norm=W.CLIP)
    batch = W.data()[:2]
    out: dict[str, str] = {}

    def outcome(case: str, run: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except Exception as err:  # compared across ranks by the test
            out[case] = f"{type(err).__name__}: {err}"
        return None

    full, state = grad_fn(batch, state=state, end_step=False)
    outcome("second_call", grad_fn, batch, state=state, reduce_scatter=True)
    opt.accumulate(full)
    last, state = grad_fn(batch, state=state)  # call 2 closes the step
    rows, state = grad_fn(batch, state=state, reduce_scatter=True)
    outcome("after_full", opt.accumulate, rows)
    opt.zero_grad()
    opt.accumulate(rows)
    outcome("after_scattered", opt.accumulate, last)
    out["pending"] = str(opt.pending_batches)
    opt.step()
    # reduced at the end of the call: no chunk ran (an empty global batch), or normalize_by ≠ 1
    empty, state = grad_fn(batch[:0], state=state, reduce_scatter=True)
    out["empty"] = str(all(not bool(v.to_local().any()) for v in empty.values()))
    halved, _ = sharded_clipped_grad(
        W.losses_of(model), model, clipping_norm=W.CLIP, normalize_by=2.0
    )
    half, _ = halved(batch, state=state, reduce_scatter=True)
    whole, _ = grad_fn(batch, state=state, reduce_scatter=True)
    out["halved"] = str(
        all(
            torch.allclose(2 * half[n].to_local(), v.to_local(), atol=1e-7)
            for n, v in whole.items()
        )
    )
    # an evaluation forward leaves FSDP's root unit gathered: the call reshards it first, so
    # its sums are still this rank's rows, laid out like the parameters
    with torch.no_grad():
        W.losses_of(model)(batch)
    after_eval, state = grad_fn(batch, state=state, reduce_scatter=True)
    out["after_eval"] = str(
        all(
            hasattr(v, "to_local") and v.to_local().shape == whole[n].to_local().shape
            for n, v in after_eval.items()
        )
    )
    opt.zero_grad()
    opt.accumulate(after_eval)
    opt.step()
    return out


def scatter_checks(W: ModuleType, rank: int, world_size: int) -> dict[str, Any]:
    """The three runs and the refusals (every rank, in the same order)."""
    return {
        "step": one_batch_steps(W, rank, world_size, scatter=False, microbatch=None),
        "scatter": one_batch_steps(W, rank, world_size, scatter=True, microbatch=None),
        "scatter_chunks": one_batch_steps(W, rank, world_size, scatter=True, microbatch=2),
        "misuse": misuse(W, world_size),
    }
