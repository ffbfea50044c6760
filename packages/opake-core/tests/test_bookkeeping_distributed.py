"""Book-keeping clipping under data parallelism: 2 gloo ranks on CPU, launched here.

This file is also the worker: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python
test_bookkeeping_distributed.py OUTDIR``. Each rank takes its shard of the global Poisson
batches, computes clipped sums with ``clipped_grad(BatchedLoss(...), engine="bookkeeping")``
(two physical batches per step, microbatches of 2) on a DDP-wrapped sequence model (embedding,
a linear map over the sequence, a LayerNorm, a classifier), and steps a
``DistributedDPOptimizer``. The reference, computed in the test process: the obvious DP-SGD
(a per-example autograd loop, clip, sum, one noise draw from the same seed, divide by q·N,
SGD) on the global batches.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # two fresh interpreters importing torch: ~20 s

N, Q, STEPS = 20, 0.3, 3
SAMPLER_SEED, NOISE_SEED = 5, 11
SIGMA, CLIP, LR = 0.5, 0.7, 0.5
VOCAB, SEQ = 16, 6


class SeqModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.mix = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.mix(self.emb(ids))))
        return self.head(h.mean(dim=1))


def make_model(seed: int) -> SeqModel:
    torch.manual_seed(seed)
    return SeqModel()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (N, SEQ), generator=gen), torch.randint(
        0, 3, (N,), generator=gen
    )


def batched_loss(fmodel: Any) -> Any:
    from opake.dpsgd.bookkeeping import BatchedLoss

    def losses(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fmodel(p, ids), y, reduction="none")

    return BatchedLoss(losses, fmodel)


def train(rank: int, world_size: int) -> dict[str, Any]:
    """The rank's run; returns its final parameters and the engine every call used."""
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import DistributedDPOptimizer
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    ids, y = data()
    model = make_model(seed=rank)  # rank 1 starts elsewhere: the optimizer broadcasts rank 0's
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = DistributedDPOptimizer(
        torch.optim.SGD(ddp.parameters(), lr=LR),
        ddp,
        sampler=sampler,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
    )
    fmodel, params = make_functional(model)
    grad_fn, state = clipped_grad(
        batched_loss(fmodel),
        clipping_norm=CLIP,
        batch_argnums=(1, 2),
        microbatch_size=2,
        engine="bookkeeping",
    )
    engines, sizes = set(), []
    for _, idx in zip(range(STEPS), sampler, strict=False):
        sizes.append(len(idx))
        half = (len(idx) + 1) // 2
        for part in (idx[:half], idx[half:]):
            rows = torch.tensor(part, dtype=torch.long)
            grads, state = grad_fn(params, ids[rows], y[rows], state=state)
            engines.add(grad_fn.engine)
            opt.accumulate(grads)
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "engines": sorted(engines),
        "sizes": sizes,
    }


def oracle() -> dict[str, torch.Tensor]:
    """Per-example autograd loop on the global batches, one noise draw per step, SGD."""
    from opake.core.testing import reference_clipped_grad
    from opake.dpsgd.noise import GaussianNoise
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    fmodel, params = make_functional(make_model(seed=0))
    params = {n: p.detach().clone() for n, p in params.items()}
    one = batched_loss(fmodel).per_example(batch_argnums=(1, 2), has_aux=False)
    ids, y = data()
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED)
    noise = GaussianNoise(SIGMA, seed=NOISE_SEED)
    for step in range(STEPS):
        idx = torch.as_tensor(sampler.global_batch(step), dtype=torch.long)
        total = reference_clipped_grad(
            one, (params, ids[idx], y[idx]), clipping_norm=CLIP, batch_argnums=(1, 2)
        )
        noisy = noise.add({n: v.float() for n, v in total.items()}, sensitivity=CLIP)
        params = {n: p - LR * noisy[n] / (N * Q) for n, p in params.items()}
    return params


def test_two_ranks_with_bookkeeping_equal_the_per_example_oracle(tmp_path, ranks_launcher):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("this PyTorch build has no gloo backend")
    R = ranks_launcher
    R.require_success(R.launch([sys.executable, __file__, str(tmp_path)]))
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert runs[0]["engines"] == runs[1]["engines"] == ["bookkeeping"]
    assert all(sum(a) > 0 for a in zip(*(r["sizes"] for r in runs), strict=True))
    want = oracle()
    for name, value in want.items():
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], value, atol=2e-6, rtol=1e-5)


def main(out: Path) -> int:
    from opake.dpsgd.distributed import init_distributed

    torch.set_num_threads(1)
    with init_distributed(backend="gloo", timeout=60.0) as ctx:
        try:
            result = train(ctx.rank, ctx.world_size)
            torch.save(result, out / f"rank{ctx.rank}.pt")
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in destroy_process_group for a rank that is gone
    return 0


if __name__ == "__main__":
    status = main(Path(sys.argv[1]))
    # the group is destroyed and the output is on disk: skip the interpreter's finalization,
    # where a gloo worker thread can abort the process ("terminate called without an active
    # exception") after a run that has succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
