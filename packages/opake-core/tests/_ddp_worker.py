"""One rank of the distributed tests (launched by test_distributed*.py as a subprocess).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python _ddp_worker.py SCENARIO OUTDIR

(the environment ``torchrun`` sets; ``torchrun ... _ddp_worker.py SCENARIO OUTDIR`` works too).
Each scenario writes ``OUTDIR/<name>.rank<r>.pt`` with what the test compares. The training
functions also run in the test process itself with ``world_size=1`` (no process group), to
produce the single-process reference.

Scenarios: ``train`` (every happy-path check in one process group), ``small`` (the MLP run
only, for the torchrun test), ``fail`` (rank 1 raises while rank 0 checkpoints), ``fail_step``
(rank 1 raises mid-step), ``hang`` (rank 1 is stuck; the timeout and the watchdog end it).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# -- configuration shared with the tests -------------------------------------------------------

N = 24  # dataset size
Q = 0.15  # global Poisson rate
STEPS = 5
SAMPLER_SEED = 60  # global batch sizes [4, 0, 3, 1, 3]: an empty step and a one-example step
NOISE_SEED = 11
SIGMA = 0.7
CLIP = 1.0
LR = 0.5
LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 128}
SEQ = 8


def mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=gen) * torch.linspace(0.2, 5.0, N)[:, None]
    y = torch.randint(0, 4, (N,), generator=gen)
    return x, y


def make_mlp(seed: int = 0) -> torch.nn.Module:
    from opake.core import testing

    return testing.tiny_mlp(in_features=8, hidden=16, classes=4, seed=seed)


def mlp_loss(fmodel: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fmodel(params, x[None]), y[None])

    return loss_fn


def _chunks(idx: list[int], parts: int) -> list[list[int]]:
    """Split a shard into ``parts`` physical batches (some possibly empty)."""
    size = -(-len(idx) // parts) if idx else 0
    return [idx[i * size : (i + 1) * size] for i in range(parts)]


def _optimizer_cls(world_size: int) -> Any:
    if world_size == 1:
        from opake.dpsgd.optimizer import DPOptimizer

        return DPOptimizer
    from opake.dpsgd.distributed import DistributedDPOptimizer

    return DistributedDPOptimizer


def train_mlp(
    rank: int,
    world_size: int,
    *,
    chunks: int = 2,
    microbatch_size: int | None = 1,
    wrap_ddp: bool = False,
    noise: dict[str, Any] | None = None,
    steps: int = STEPS,
    optim: str = "sgd",
) -> dict[str, Any]:
    """DP-SGD on the tiny MLP with Poisson shards, accumulation and microbatching."""
    from opake.accounting import RDPAccountant
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    x, y = mlp_data()
    # ranks > 0 start from different weights: the optimizer must broadcast rank 0's
    model = make_mlp(seed=rank)
    module: torch.nn.Module = model
    if wrap_ddp:
        module = torch.nn.parallel.DistributedDataParallel(model)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    accountant = RDPAccountant()
    opt = _optimizer_cls(world_size)(
        _torch_optimizer(optim, module.parameters()),
        module,
        sampler=sampler,
        accountant=accountant,
        delta=1e-5,
        **(noise if noise is not None else {"noise_multiplier": SIGMA, "seed": NOISE_SEED}),
    )
    fmodel, params = make_functional(model)
    grad_fn, state = clipped_grad(
        mlp_loss(fmodel), clipping_norm=CLIP, batch_argnums=(1, 2), microbatch_size=microbatch_size
    )
    reports, local_sizes = [], []
    for _, idx in zip(range(steps), sampler, strict=False):
        local_sizes.append(len(idx))
        for part in _chunks(idx, chunks):
            rows = torch.tensor(part, dtype=torch.long)
            grads, state = grad_fn(params, x[rows], y[rows], state=state)
            opt.accumulate(grads)
        report = opt.step()
        reports.append(
            {
                "step": report.step,
                "physical_batches": report.physical_batches,
                "sensitivity": report.sensitivity,
                "expected_batch_size": report.expected_batch_size,
                "sample_rate": report.sample_rate,
                "epsilon": report.epsilon,
            }
        )
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "reports": reports,
        "local_sizes": local_sizes,
        "noise_sync": getattr(opt, "noise_sync", None),
        "model": model,
        "optimizer": opt,
        "accountant": accountant,
        "sampler": sampler,
    }


def _torch_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=LR)


def train_fsdp(
    rank: int, world_size: int, *, optim: str = "sgd", secure: bool = False, steps: int = STEPS
) -> dict[str, Any]:
    """The MLP run of train_mlp with FSDP2-sharded parameters and optimizer state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.accounting import RDPAccountant
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import ShardedDPOptimizer, compute_template, gather_full_params
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    x, y = mlp_data()
    model = make_mlp(seed=0)  # FSDP2 shards each rank's own copy: initialise identically
    fmodel, _ = make_functional(compute_template(model))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = ShardedDPOptimizer(
        _torch_optimizer(optim, model.parameters()),
        model,
        sampler=sampler,
        accountant=RDPAccountant(),
        delta=1e-5,
        noise_multiplier=SIGMA,
        **({"secure": True} if secure else {"seed": NOISE_SEED}),
    )
    grad_fn, state = clipped_grad(
        mlp_loss(fmodel), clipping_norm=CLIP, batch_argnums=(1, 2), microbatch_size=1
    )
    reports = []
    for _, idx in zip(range(steps), sampler, strict=False):
        full = gather_full_params(model)
        for part in _chunks(idx, 2):
            rows = torch.tensor(part, dtype=torch.long)
            grads, state = grad_fn(full, x[rows], y[rows], state=state)
            opt.accumulate(grads)
        report = opt.step()
        reports.append({"physical_batches": report.physical_batches, "epsilon": report.epsilon})
    local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    state_shapes = {
        name: tuple(opt.optimizer.state[p]["exp_avg"].to_local().shape)
        for name, p in model.named_parameters()
        if "exp_avg" in opt.optimizer.state.get(p, {})
    }
    from opake.dpsgd.distributed import save_checkpoint_distributed

    refused = _error(
        lambda: save_checkpoint_distributed(Path("unused.pt"), step=STEPS, model=model)
    )
    return {
        "params": {n: t.clone() for n, t in gather_full_params(model).items()},
        "checkpoint_refused": refused,
        "noise_sync": opt.noise_sync,
        "local_shapes": local_shapes,
        "state_shapes": state_shapes,
        "reports": reports,
    }


def fsdp_two_models(rank: int, world_size: int) -> dict[str, Any]:
    """Two models sharded in one process, each over its own (equal) mesh: DTensor's spec cache
    hands the second model's layer of an already seen shape the first call's mesh object, so
    its parameters report two mesh objects for one mesh. The optimizer must accept it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.dpsgd.distributed import ShardedDPOptimizer

    def build(classes: int) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, classes)
        )
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    build(4)
    second = build(3)  # layer 0's shapes were seen above, layer 2's were not
    objects = len({id(p.device_mesh) for p in second.parameters()})
    error = _error(
        lambda: ShardedDPOptimizer(
            torch.optim.SGD(second.parameters(), lr=LR),
            second,
            noise_multiplier=SIGMA,
            seed=NOISE_SEED,
            expected_batch_size=float(N * Q),
        )
    )
    return {"mesh_objects": objects, "error": error}


def train_adaptive(rank: int, world_size: int, *, secure: bool = False) -> dict[str, Any]:
    """Adaptive clipping through logical_step: the bound follows the count of all ranks
    (``secure``: secure noise and a state without a seed, whose count noise rank 0 draws
    from its secure source and broadcasts)."""
    from opake.dpsgd.clipping import AdaptiveClipping, clipped_grad
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    x, y = mlp_data()
    model = make_mlp(seed=0)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = _optimizer_cls(world_size)(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        sampler=sampler,
        noise_multiplier=SIGMA,
        seed=None if secure else NOISE_SEED,
    )
    fmodel, params = make_functional(model)
    start = AdaptiveClipping(
        0.5,
        count_noise_multiplier=1.0,
        expected_batch_size=N * Q,
        learning_rate=0.5,
        seed=None if secure else 5,
    )
    grad_fn, state = clipped_grad(mlp_loss(fmodel), clipping_norm=start, batch_argnums=(1, 2))
    bounds = []
    for _, idx in zip(range(STEPS), sampler, strict=False):
        batches = [(x[torch.tensor(p, dtype=torch.long)], y[p]) for p in _chunks(idx, 2)]
        _, state = opt.logical_step(grad_fn, params, batches, state=state)
        bounds.append(state.clipping_norm)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bounds": bounds,
    }


def train_llama(rank: int, world_size: int) -> dict[str, Any]:
    """Two DP steps on a tiny Llama (causal LM loss, per-example vmap) over Poisson shards."""
    from opake.core import testing
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    model = testing.tiny_llama(**LLAMA, seed=0)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, LLAMA["vocab_size"], (12, SEQ), generator=gen)
    sampler = PoissonSampler(12, 0.34, seed=2, rank=rank, world_size=world_size)
    opt = _optimizer_cls(world_size)(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        model,
        sampler=sampler,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
    )
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss_fn = testing.causal_lm_loss(fmodel)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=CLIP, batch_argnums=(2, 3), microbatch_size=2, check_unused=False
    )
    sizes = []
    for _, idx in zip(range(2), sampler, strict=False):
        sizes.append(len(idx))
        rows = torch.tensor(idx, dtype=torch.long)
        grads, state = grad_fn(trainable, frozen, ids[rows], ids[rows], state=state)
        opt.accumulate(grads)
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "local_sizes": sizes,
    }


# -- distributed-only checks ---------------------------------------------------------------------


def _error(fn: Callable[[], Any]) -> str | None:
    """Run ``fn``; return ``"Type: message"`` of what it raised (``None`` if nothing)."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def secure_defaults(rank: int, world_size: int) -> dict[str, Any]:
    """The default randomness across ranks: one secure key, drawn on rank 0, never a seed."""
    from opake.dpsgd.distributed import DistributedDPOptimizer, shared_randomness
    from opake.dpsgd.randomness import Randomness
    from opake.dpsgd.sampling import PoissonSampler

    model = make_mlp()
    sampler = PoissonSampler(N, Q, randomness=shared_randomness(), rank=rank, world_size=world_size)
    opt = DistributedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model, noise_multiplier=SIGMA, sampler=sampler
    )
    own = PoissonSampler(N, Q, randomness=Randomness.secure(), rank=rank, world_size=world_size)
    return {
        "noise_sync": opt.noise_sync,
        "noise_secure": opt.noise.secure,
        "noise_key": opt.noise.randomness.fingerprint,
        "sampler_key": sampler.randomness.fingerprint,
        "batch": sampler.global_batch(0).tolist(),
        "own_keys": _error(
            lambda: DistributedDPOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR),
                model,
                noise_multiplier=SIGMA,
                sampler=own,
            )
        ),
    }


def misconfigurations(rank: int, world_size: int) -> dict[str, str | None]:
    """Mistakes on one rank must raise on *every* rank (and leave the group usable)."""
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import DistributedDPOptimizer, check_replicas_in_sync
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    x, y = mlp_data()
    model = make_mlp()

    def build(**options: Any) -> DistributedDPOptimizer:
        kwargs: dict[str, Any] = {"noise_multiplier": SIGMA, "expected_batch_size": N * Q}
        kwargs.update(options)
        return DistributedDPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, **kwargs)

    out: dict[str, str | None] = {}
    out["seed"] = _error(lambda: build(seed=NOISE_SEED + rank))
    wrong = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=0, world_size=world_size)
    out["shard"] = _error(lambda: build(seed=NOISE_SEED, sampler=wrong, expected_batch_size=None))
    out["rate"] = _error(lambda: build(seed=NOISE_SEED, expected_batch_size=N * Q + rank))
    out["replicated_secure"] = _error(lambda: build(secure=True, noise_sync="replicated"))

    fmodel, params = make_functional(model)
    opt = build(seed=NOISE_SEED)

    def idle_step() -> None:
        if rank == 0:
            grad_fn, state = clipped_grad(
                mlp_loss(fmodel), clipping_norm=CLIP, batch_argnums=(1, 2)
            )
            opt.accumulate(grad_fn(params, x[:2], y[:2], state=state)[0])
        opt.step()

    out["idle"] = _error(idle_step)
    out["idle_pending_after"] = str(opt.pending_batches)

    def mixed_bounds() -> None:
        grad_fn, state = clipped_grad(
            mlp_loss(fmodel), clipping_norm=CLIP * (1 + rank), batch_argnums=(1, 2)
        )
        opt.accumulate(grad_fn(params, x[:2], y[:2], state=state)[0])
        opt.step()

    out["sensitivity"] = _error(mixed_bounds)

    def ddp_keys() -> None:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        wrapped_opt = DistributedDPOptimizer(
            torch.optim.SGD(ddp.parameters(), lr=LR),
            ddp,
            noise_multiplier=SIGMA,
            expected_batch_size=N * Q,
            seed=NOISE_SEED,
        )
        fddp, dparams = make_functional(ddp)
        grad_fn, state = clipped_grad(mlp_loss(fddp), clipping_norm=CLIP, batch_argnums=(1, 2))
        wrapped_opt.accumulate(grad_fn(dparams, x[:2], y[:2], state=state)[0])

    out["ddp_keys"] = _error(ddp_keys)

    def diverged() -> None:
        if rank == 1:
            with torch.no_grad():
                model[0].bias[0] += 1e-6
        check_replicas_in_sync(model)

    out["diverged"] = _error(diverged)
    return out


def _drift_training(
    rank: int, world_size: int, sigma: float = 1e-3
) -> tuple[Any, torch.nn.Module, torch.Tensor]:
    """The red-team's probe of finding F3: example k's gradient is 5·e_k (clipped to e_k), so
    coordinate k of the released sum counts how often example k is in one logical step."""
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    n = 16
    model = torch.nn.Linear(n, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    fmodel, params = make_functional(model)

    def loss_fn(p: Any, x: torch.Tensor) -> torch.Tensor:
        return fmodel(p, x[None])[0, 0]

    training = DPTraining(
        loss_fn,
        torch.optim.SGD(model.parameters(), lr=1.0),
        params,
        module=model,
        dataset_size=n,
        sample_rate=0.5,
        noise_multiplier=sigma,
        delta=1e-5,
        accountant="rdp",
        clipping_norm=1.0,
        seed=3,
    )
    return training, model, torch.eye(n) * 5.0


def sampler_drift(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks whose loops consume different numbers of sampler batches (finding F3) must raise
    on every rank before anything is noised or accounted; a look-ahead alike on every rank (a
    prefetching loader) must not."""
    from opake.dpsgd.sampling import PoissonSampler

    out: dict[str, Any] = {}
    training, model, x = _drift_training(rank, world_size)
    batches = training.batches()
    if rank == 1:
        next(batches)  # e.g. `if len(idx) == 0: continue` on this rank only
    out["training"] = _error(lambda: training.step(x[next(batches)]))
    out["training_after"] = {
        "steps": training.steps,
        "accounted": training.accountant.steps,
        "pending": training.pending_batches,
        "weight_moved": bool(model.weight.detach().abs().max() > 0),
    }

    # a one-batch look-ahead on every rank (as a DataLoader's prefetch): positions stay equal
    training, model, x = _drift_training(rank, world_size)
    ahead = training.batches()
    queued = [next(ahead)]
    for _ in range(2):
        queued.append(next(ahead))
        training.step(x[queued.pop(0)])
    out["lookahead_steps"] = training.steps

    # DistributedDPOptimizer(sampler=) with the documented loop; rank 1 skips one batch
    model = make_mlp()
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = _optimizer_cls(world_size)(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        sampler=sampler,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
    )
    shards = iter(sampler)
    if rank == 1:
        next(shards)
    next(shards)
    out["optimizer"] = _error(lambda: train_step_zero(opt, model))  # the shard's sum: zeros
    out["optimizer_after"] = {"steps": opt.steps, "pending": opt.pending_batches}

    # one rank refuses its step (DPTraining: more examples summed than drawn): every rank raises
    model = make_mlp()
    opt = _optimizer_cls(world_size)(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
        expected_batch_size=4.0,
    )
    if rank == 1:
        opt.refuse_step("summed 9 examples, drew 4")
    out["refused"] = _error(lambda: train_step_zero(opt, model))
    out["refused_after"] = {"steps": opt.steps, "pending": opt.pending_batches}

    # one rank lowers σ mid-run: one draw at two scales would reveal the noise
    opt.noise_multiplier = SIGMA / 2 if rank == 1 else SIGMA
    out["sigma"] = _error(lambda: train_step_zero(opt, model))
    out["sigma_after"] = {"steps": opt.steps, "pending": opt.pending_batches}
    return out


def lopsided_load(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """``DPTraining.load`` refused on rank 0 only (its file says another σ; rank 1 sees no
    file): every rank must raise before anything is restored, none wait in the loader."""
    first, _, x = _drift_training(rank, world_size)
    first.step(x[next(first.batches())])
    path = first.save(out / "lopsided.pt")
    resumed, _, _ = _drift_training(rank, world_size, sigma=2e-3)
    seen = path if rank == 0 else out / "not-on-this-rank.pt"
    return {
        "error": _error(lambda: resumed.load(seen)),
        "after": {"steps": resumed.steps, "accounted": resumed.accountant.steps},
    }


def lopsided_components(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """``load_checkpoint_distributed`` of a file that rank 1 refuses (the file holds an RDP
    accountant, rank 1 passes a PLD one) while rank 0 accepts it: every rank must raise before
    anything is restored, and rank 0 must not go on alone."""
    from opake.accounting import PLDAccountant, RDPAccountant
    from opake.dpsgd.distributed import load_checkpoint_distributed, save_checkpoint_distributed
    from opake.dpsgd.sampling import PoissonSampler

    trained = train_mlp(rank, world_size, steps=2)
    path = save_checkpoint_distributed(
        out / "lopsided_components.pt",
        step=2,
        model=trained["model"],
        optimizer=trained["optimizer"],
        accountant=trained["accountant"],
        sampler=trained["sampler"],
    )
    model = make_mlp(seed=rank)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    opt = _optimizer_cls(world_size)(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        sampler=sampler,
        accountant=RDPAccountant(),
        delta=1e-5,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
    )
    accountant = PLDAccountant() if rank == 1 else RDPAccountant()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    error = _error(
        lambda: load_checkpoint_distributed(
            path, model=model, optimizer=opt, accountant=accountant, sampler=sampler
        )
    )
    return {
        "error": error,
        "after": {
            "steps": opt.steps,
            "accounted": accountant.steps,
            "model_unchanged": all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
        },
    }


def _drop_live(result: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in result.items() if k not in {"model", "optimizer", "accountant", "sampler"}
    }


GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "distributed.md"


def guide_script() -> str | None:
    """The training script of docs/guide/distributed.md (None outside the repository)."""
    import re

    if not GUIDE.is_file():
        return None
    found = re.search(r"## A training script\n\n```python\n(.*?)```", GUIDE.read_text(), re.S)
    return found.group(1) if found else ""


def run_guide_script(directory: Path) -> dict[str, Any] | None:
    """Run the guide's script on this rank, inside ``directory`` (where it checkpoints)."""
    source = guide_script()
    if source is None:
        return None
    directory.mkdir(exist_ok=True)
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        namespace: dict[str, Any] = {"__name__": "guide"}
        exec(compile(source, str(GUIDE), "exec"), namespace)
    finally:
        os.chdir(cwd)
    return {
        "steps": namespace["report"].step,
        "params": {n: p.detach().clone() for n, p in namespace["model"].named_parameters()},
        "checkpoint": (directory / "ckpt.pt").is_file(),
    }


def scenario_train(rank: int, world_size: int, out: Path) -> None:
    from opake.dpsgd.distributed import (
        gather_metrics,
        load_checkpoint_distributed,
        save_checkpoint_distributed,
    )

    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        timings[name] = time.perf_counter() - start
        return value

    results: dict[str, Any] = {}
    mlp = timed("mlp", lambda: train_mlp(rank, world_size))
    results["mlp"] = _drop_live(mlp)
    results["ddp"] = _drop_live(timed("ddp", lambda: train_mlp(rank, world_size, wrap_ddp=True)))
    results["one_chunk"] = _drop_live(
        timed("one_chunk", lambda: train_mlp(rank, world_size, chunks=1, microbatch_size=None))
    )
    results["broadcast"] = _drop_live(
        timed(
            "broadcast",
            lambda: train_mlp(
                rank, world_size, steps=2, noise={"noise_multiplier": SIGMA, "secure": True}
            ),
        )
    )
    results["adaptive"] = timed("adaptive", lambda: train_adaptive(rank, world_size))
    results["adaptive_secure"] = timed(
        "adaptive_secure", lambda: train_adaptive(rank, world_size, secure=True)
    )
    results["fsdp"] = timed("fsdp", lambda: train_fsdp(rank, world_size))
    results["fsdp_adam"] = timed("fsdp_adam", lambda: train_fsdp(rank, world_size, optim="adam"))
    results["fsdp_secure"] = timed(
        "fsdp_secure", lambda: train_fsdp(rank, world_size, secure=True, steps=2)
    )
    results["fsdp_two_models"] = timed("fsdp_two_models", lambda: fsdp_two_models(rank, world_size))
    results["llama"] = timed("llama", lambda: train_llama(rank, world_size))
    results["errors"] = timed("errors", lambda: misconfigurations(rank, world_size))
    results["secure"] = timed("secure", lambda: secure_defaults(rank, world_size))
    results["drift"] = timed("drift", lambda: sampler_drift(rank, world_size))
    results["lopsided"] = timed("lopsided", lambda: lopsided_load(rank, world_size, out))
    results["lopsided_components"] = timed(
        "lopsided_components", lambda: lopsided_components(rank, world_size, out)
    )
    results["guide"] = timed("guide", lambda: run_guide_script(out / "guide"))

    # checkpoint: rank 0 writes; every rank restores into fresh objects (own RNG state back)
    path = out / "ckpt.pt"
    torch.manual_seed(1000 + rank)
    rng_before = torch.get_rng_state()
    save_checkpoint_distributed(
        path,
        step=STEPS,
        model=mlp["model"],
        optimizer=mlp["optimizer"],
        accountant=mlp["accountant"],
        sampler=mlp["sampler"],
    )
    torch.manual_seed(7)
    fresh = train_mlp(rank, world_size, steps=0)
    ckpt = load_checkpoint_distributed(
        path,
        model=fresh["model"],
        optimizer=fresh["optimizer"],
        accountant=fresh["accountant"],
        sampler=fresh["sampler"],
    )
    results["checkpoint"] = {
        "step": ckpt.step,
        "extra": ckpt.extra,
        "params": {n: p.detach().clone() for n, p in fresh["model"].named_parameters()},
        "optimizer_steps": fresh["optimizer"].steps,
        "rng_restored": bool(torch.equal(torch.get_rng_state(), rng_before)),
    }

    # profiling: per-rank step_perf (opake-profiling, when installed), aggregated over ranks
    try:
        from opake.profiling import PerfState, step_perf
    except ImportError:
        results["metrics"] = None
    else:
        perf_state = PerfState(device="cpu")
        for _ in range(2):
            with step_perf("cpu", batch_size=3 + rank) as perf:
                time.sleep(0.01 * (1 + rank))
                perf.mark("data")
                train_step_zero(mlp["optimizer"], mlp["model"])
                perf.mark("step")
            perf_state = perf_state.add(perf.result)
        results["metrics"] = {
            "step": gather_metrics(perf.result).per_rank,
            "run": gather_metrics(perf_state).to_dict(),
        }
    results["timings"] = timings
    torch.save(results, out / f"train.rank{rank}.pt")


def scenario_small(rank: int, world_size: int, out: Path) -> None:
    torch.save(_drop_live(train_mlp(rank, world_size)), out / f"small.rank{rank}.pt")


def scenario_fail(rank: int, world_size: int, out: Path, where: str) -> None:
    """One rank raises; the other must stop fast, naming it, and no checkpoint is written.

    ``where="save"``: rank 1 raises instead of joining the step-2 checkpoint (rank 0 is inside
    ``save_checkpoint_distributed``). ``where="step"``: rank 0 — the rank that hosts the
    rendezvous store here — raises mid-step while rank 1 is inside ``step()``.
    """
    from opake.dpsgd.distributed import fail_fast, save_checkpoint_distributed

    failing = 1 if where == "save" else 0
    mlp = light_run(rank, world_size)
    path = out / "ckpt.pt"
    save_checkpoint_distributed(path, step=1, model=mlp["model"], optimizer=mlp["optimizer"])
    (out / f"saved.rank{rank}").write_text("1")
    with fail_fast(grace_sec=5.0, poll_sec=0.05):
        opt = mlp["optimizer"]
        if where == "step":
            if rank == failing:
                raise ValueError(f"injected failure on rank {failing} at step 2")
            (out / f"entered.rank{rank}").write_text(str(time.time()))
            train_step_zero(opt, mlp["model"])
        else:
            train_step_zero(opt, mlp["model"])
            if rank == failing:
                raise ValueError(
                    f"injected failure on rank {failing} before the checkpoint of step 2"
                )
            (out / f"entered.rank{rank}").write_text(str(time.time()))
            save_checkpoint_distributed(
                path, step=2, model=mlp["model"], optimizer=mlp["optimizer"]
            )
    (out / f"finished.rank{rank}").write_text("1")


def train_step_zero(opt: Any, model: torch.nn.Module) -> None:
    """One logical step with an empty shard (noise only): a real collective step.

    Builds the zero sum ``clipped_grad`` returns for an empty batch directly, so the failure
    scenarios do not pay for importing ``torch.func`` in every process.
    """
    from opake.dpsgd.clipping import ClippedGrads

    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    opt.accumulate(ClippedGrads(zeros, max_norm=CLIP, batch_size=0))
    opt.step()


def light_run(rank: int, world_size: int) -> dict[str, Any]:
    """An MLP and its DistributedDPOptimizer, one noise-only step taken."""
    from opake.dpsgd.distributed import DistributedDPOptimizer

    model = make_mlp(seed=rank)
    opt = DistributedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        noise_multiplier=SIGMA,
        expected_batch_size=N * Q,
        seed=NOISE_SEED,
    )
    train_step_zero(opt, model)
    return {"model": model, "optimizer": opt}


def scenario_hang(rank: int, world_size: int, out: Path) -> None:
    """Rank 1 is stuck (no exception): the timeout fails rank 0, the watchdog aborts rank 1."""
    from opake.dpsgd.distributed import fail_fast

    mlp = light_run(rank, world_size)
    with fail_fast(grace_sec=2.0, poll_sec=0.05):
        if rank == 1:
            (out / "stuck.rank1").write_text(str(time.time()))
            time.sleep(120)
        (out / "entered.rank0").write_text(str(time.time()))
        train_step_zero(mlp["optimizer"], mlp["model"])
    (out / f"finished.rank{rank}").write_text("1")


def main(argv: list[str]) -> int:
    from opake.dpsgd.distributed import init_distributed

    scenario, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    timeout = float(os.environ.get("OPAKE_TEST_TIMEOUT", "60"))
    with init_distributed(backend="gloo", timeout=timeout) as ctx:
        rank, world_size = ctx.rank, ctx.world_size
        try:
            if scenario == "train":
                scenario_train(rank, world_size, out)
            elif scenario == "small":
                scenario_small(rank, world_size, out)
            elif scenario in ("fail", "fail_step"):
                scenario_fail(rank, world_size, out, "save" if scenario == "fail" else "step")
            elif scenario == "hang":
                scenario_hang(rank, world_size, out)
            else:
                raise SystemExit(f"unknown scenario {scenario!r}")
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in destroy_process_group for ranks that are gone
    # The group is destroyed and every output is on disk. Skip the interpreter's finalization:
    # a gloo worker thread torn down during it can abort the process (SIGABRT, "terminate
    # called without an active exception"), which would fail a run that has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
