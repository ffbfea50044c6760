"""One rank of test_distributed_sharded_compute.py (level 2: per-layer sharded compute).

``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python _sharded_worker.py SCENARIO OUTDIR``.
A tiny Llama-like causal LM from a config, its blocks and root ``fully_shard``-ed;
``sharded_clipped_grad`` computes the clipped sums with FSDP gathering one unit at a time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

N, Q, STEPS = 16, 0.3, 3
SAMPLER_SEED, NOISE_SEED = 5, 11
SIGMA, CLIP, LR = 0.5, 0.7, 0.5
SEQ = 6


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 16
    hidden: int = 8
    heads: int = 2
    mlp: int = 12
    layers: int = 2


class Block(torch.nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d = cfg.hidden
        self.heads = cfg.heads
        self.attn_norm = torch.nn.RMSNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(d, d, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(d)
        self.gate = torch.nn.Linear(d, cfg.mlp, bias=False)
        self.up = torch.nn.Linear(d, cfg.mlp, bias=False)
        self.down = torch.nn.Linear(cfg.mlp, d, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(h)
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(a.transpose(1, 2).reshape(h.shape))
        x = self.mlp_norm(h)
        return h + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class TinyLlama(torch.nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = torch.nn.RMSNorm(cfg.hidden)
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Scale(torch.nn.Module):
    """A layer no built-in rule handles (only the per-layer vmap fallback matches it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def make_model(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(TinyConfig())


def data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, TinyConfig().vocab, (N, SEQ), generator=gen)


def losses_of(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from opake.dpsgd.bookkeeping import causal_lm_losses

    def losses(ids: torch.Tensor) -> torch.Tensor:
        return causal_lm_losses(model(ids), ids)

    return losses


def shard(model: torch.nn.Module, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for unit in units_of(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Counts:
    """FSDP's own all-gathers and reduce-scatters (those of the per-example check's backward
    through the module apart), and the optimizer's reduce-scatters."""

    def __init__(self) -> None:
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

        import opake.dpsgd.distributed.sharded._autograd as check

        self.gathers = self.fsdp_reduces = self.check_reduces = self.opt_reduces = 0
        gather, reduce, fsdp_sum = group.foreach_all_gather, group.foreach_reduce, check.fsdp_sum
        checking: list[bool] = []

        def counted_gather(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return gather(*args, **kwargs)

        def counted_reduce(*args: Any, **kwargs: Any) -> Any:
            if checking:
                self.check_reduces += 1
            else:
                self.fsdp_reduces += 1
            return reduce(*args, **kwargs)

        @contextlib.contextmanager
        def in_check(model: torch.nn.Module) -> Iterator[None]:
            checking.append(True)
            try:
                with fsdp_sum(model):
                    yield
            finally:
                checking.pop()

        group.foreach_all_gather = counted_gather
        group.foreach_reduce = counted_reduce
        check.fsdp_sum = in_check


def _halves(idx: list[int]) -> list[list[int]]:
    half = (len(idx) + 1) // 2
    return [idx[:half], idx[half:]]


def make_lora(seed: int = 0) -> torch.nn.Module:
    """The tiny model with PEFT LoRA adapters (r=2) on q, v and the head; the rest frozen."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 100)  # the adapters' initialisation
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v", "head"], lora_dropout=0.0)
    return get_peft_model(make_model(seed), config)


def units_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units below the root: every block, and the head alone (a hooked layer that is
    a unit by itself: FSDP reshards it before the engine's hook runs)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [*inner.blocks, inner.head]


def run_steps(
    model: torch.nn.Module,
    rank: int,
    world_size: int,
    counts: Counts | None = None,
    *,
    compute: torch.dtype | None = None,
) -> tuple[dict[str, Any], Any, Any]:
    """STEPS logical steps on Poisson shards (2 physical batches per rank, microbatches of 2);
    returns the record, the optimizer and the grad_fn (its state inside the record).
    ``compute``: FSDP's ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from opake.accounting import RDPAccountant
    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad
    from opake.dpsgd.sampling import PoissonSampler

    ids = data()
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for unit in units_of(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = ShardedDPOptimizer(
        torch.optim.SGD(trainable, lr=LR),
        model,
        sampler=sampler,
        accountant=RDPAccountant(),
        delta=1e-5,
        noise_multiplier=SIGMA,
        seed=NOISE_SEED,
    )
    reduced: list[torch.dtype] = []
    inner = opt._reduce_scatter

    def reduce_scatter(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        reduced.append(full.dtype)
        if counts is not None:
            counts.opt_reduces += 1
        return inner(full, like)

    opt._reduce_scatter = reduce_scatter
    grad_fn, state = sharded_clipped_grad(
        losses_of(model), model, clipping_norm=CLIP, microbatch_size=2
    )
    sizes, reduces, epsilon = [], [], 0.0
    for _, idx in zip(range(STEPS), sampler, strict=False):
        sizes.append(len(idx))
        before = len(reduced)
        for part in _halves(idx):
            grads, state = grad_fn(ids[torch.tensor(part, dtype=torch.long)], state=state)
            opt.accumulate(grads)
        epsilon = opt.step().epsilon or 0.0
        reduces.append(len(reduced) - before)
    record = {
        "sizes": sizes,
        "reduces": reduces,
        "reduce_dtypes": sorted({str(d) for d in reduced}),
        "n_params": len(trainable),
        "engine": grad_fn.engine,
        "epsilon": epsilon,
        "state": state,
    }
    return record, opt, grad_fn


def train(rank: int, world_size: int, counts: Counts) -> dict[str, Any]:
    """STEPS logical steps, then one step on an empty global batch (the noise alone)."""
    from opake.dpsgd.distributed import gather_full_params

    model = make_model()
    record, opt, grad_fn = run_steps(model, rank, world_size, counts)
    trained = {n: t.clone() for n, t in gather_full_params(model).items()}
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    grads, _ = grad_fn(data()[:0], state=record.pop("state"))
    opt.accumulate(grads)
    opt.step()
    record["noise_rows"] = {
        n: (p.to_local().detach() - local[n]).clone() for n, p in model.named_parameters()
    }
    record["noise_full"] = {n: t - trained[n] for n, t in gather_full_params(model).items()}
    record["params"] = trained
    record["fsdp_reduces"] = counts.fsdp_reduces
    record["check_reduces"] = counts.check_reduces
    return record


def adapters(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 2: PEFT LoRA; the model in bf16; fp32 parameters, bf16 compute; fp32 sums, noise."""
    from opake.dpsgd.distributed import gather_full_params

    out: dict[str, Any] = {}
    runs = (
        ("lora", make_lora(), None),
        ("bf16", make_model().to(torch.bfloat16), None),
        ("mixed", make_model(), torch.bfloat16),
    )
    for name, model, compute in runs:
        record, _, _ = run_steps(model, rank, world_size, compute=compute)
        record.pop("state")
        record["params"] = {n: t.clone() for n, t in gather_full_params(model).items()}
        record["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
        out[name] = record
    return out


def one_example(rank: int, world_size: int) -> dict[str, float]:
    """‖S(D) − S(D')‖ for D' = D without one example of rank 1 (masked, or dropped), with the
    sums reduced by the caller and reduce-scattered inside the call (``reduce_scatter=True``)."""
    import torch.distributed as dist

    from opake.dpsgd.distributed import sharded_clipped_grad

    ids = data()
    model = make_model(seed=1)
    shard(model, world_size)
    grad_fn, state = sharded_clipped_grad(
        losses_of(model), model, clipping_norm=0.1, microbatch_size=2
    )
    mine = ids[rank * 3 : rank * 3 + 3]
    keep = torch.tensor([True, True, rank == 0])

    def global_sum(batch: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        grads, _ = grad_fn(batch, state=state, example_mask=mask)
        flat = torch.cat([g.reshape(-1) for g in grads.values()]).double()
        dist.all_reduce(flat)
        return flat

    def scattered(batch: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows of the global sum, reduce-scattered inside the call."""
        grads, _ = grad_fn(batch, state=state, example_mask=mask, reduce_scatter=True)
        return torch.cat([g.to_local().reshape(-1) for g in grads.values()]).double()

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        sq = (a - b).square().sum()
        dist.all_reduce(sq)
        return float(sq.sqrt())

    full = global_sum(mine, None)
    masked = global_sum(mine, keep)
    dropped = global_sum(mine[keep], None)
    in_call = scattered(mine, None)
    in_call_masked = distance(in_call, scattered(mine, keep))
    in_call_dropped = distance(in_call, scattered(mine[keep], None))
    with_aux, state = sharded_clipped_grad(
        losses_of(model), model, clipping_norm=0.1, return_aux=True
    )
    # 3 rows on rank 0, none on rank 1 (an empty shard: 3 padding rows keep FSDP's collectives
    # aligned and contribute nothing)
    (grads, aux), _ = with_aux(ids[: 3 - 3 * rank], state=state)
    empty_sum = 0.0 if rank == 0 else float(sum(float(g.abs().sum()) for g in grads.values()))
    return {
        "masked": float((full - masked).norm()),
        "dropped": float((full - dropped).norm()),
        "in_call_masked": in_call_masked,
        "in_call_dropped": in_call_dropped,
        "aux_rows": [len(aux.loss_values), len(aux.grad_norms), int(aux.batch_size)],
        "empty_sum": empty_sum,
    }


def no_rule(world_size: int, counts: Counts) -> dict[str, Any]:
    """A layer without a closed-form rule: refused at construction and at the call."""
    from opake.core.errors import ConfigurationError
    from opake.dpsgd.distributed import sharded_clipped_grad

    model = make_model()
    model.norm = Scale(TinyConfig().hidden)  # type: ignore[assignment]
    shard(model, world_size)
    out: dict[str, Any] = {}
    try:
        sharded_clipped_grad(losses_of(model), model, clipping_norm=CLIP)
    except ConfigurationError as err:
        out["construction"] = str(err)
    model.norm.weight.requires_grad_(False)
    grad_fn, state = sharded_clipped_grad(losses_of(model), model, clipping_norm=CLIP)
    model.norm.weight.requires_grad_(True)
    gathers = counts.gathers
    try:
        grad_fn(data()[:2], state=state)
    except ConfigurationError as err:
        out["call"] = str(err)
    out["gathers"] = counts.gathers - gathers
    spare = make_model()
    spare.spare = torch.nn.Linear(4, 4)  # trainable, never read by the forward
    shard(spare, world_size)
    grad_fn, state = sharded_clipped_grad(losses_of(spare), spare, clipping_norm=CLIP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_fn(data()[:2], state=state)
    out["unread"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def scenario_basic(rank: int, world_size: int, out: Path) -> None:
    from _sharded_refusals import refusals  # beside this script (its directory is on sys.path)
    from _sharded_scatter import scatter_checks

    counts = Counts()
    result = {
        "train": train(rank, world_size, counts),
        "one_example": one_example(rank, world_size),
        "no_rule": no_rule(world_size, counts),
        "refusals": refusals(rank, world_size),
        "scatter": scatter_checks(sys.modules[__name__], rank, world_size),
    }
    torch.save(result, out / f"basic.rank{rank}.pt")


def scenario_train(rank: int, world_size: int, out: Path) -> None:
    """The training checks of ``basic`` alone (any world size: the opt-in 4-rank test)."""
    torch.save({"train": train(rank, world_size, Counts())}, out / f"train.rank{rank}.pt")


def resume(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    """Stage 3 (AdamW): 3 steps vs 2, a sharded checkpoint and a resumed 3rd; params, moments, ε."""
    from opake.accounting import RDPAccountant
    from opake.core.errors import OperationError
    from opake.dpsgd.distributed import (
        ShardedDPOptimizer,
        gather_full_params,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
        sharded_clipped_grad,
    )
    from opake.dpsgd.sampling import PoissonSampler

    ids = data()

    def build() -> dict[str, Any]:
        model = make_model()
        shard(model, world_size)
        sampler = PoissonSampler(N, Q, seed=SAMPLER_SEED, rank=rank, world_size=world_size)
        accountant = RDPAccountant()
        opt = ShardedDPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05),
            model,
            sampler=sampler,
            accountant=accountant,
            delta=1e-5,
            noise_multiplier=SIGMA,
            seed=NOISE_SEED,
        )
        grad_fn, state = sharded_clipped_grad(
            losses_of(model), model, clipping_norm=CLIP, microbatch_size=2
        )
        return {
            "model": model,
            "sampler": sampler,
            "accountant": accountant,
            "opt": opt,
            "fn": grad_fn,
            "state": state,
            "epsilon": 0.0,
        }

    def steps(run: dict[str, Any], count: int) -> None:
        for _, idx in zip(range(count), run["sampler"], strict=False):
            for part in _halves(idx):
                batch = ids[torch.tensor(part, dtype=torch.long)]
                grads, run["state"] = run["fn"](batch, state=run["state"])
                run["opt"].accumulate(grads)
            run["epsilon"] = run["opt"].step().epsilon

    def result(run: dict[str, Any]) -> dict[str, Any]:
        moments = {
            name: run["opt"].optimizer.state[p]["exp_avg"].full_tensor().clone()
            for name, p in run["model"].named_parameters()
        }
        params = {n: t.clone() for n, t in gather_full_params(run["model"]).items()}
        return {"params": params, "exp_avg": moments, "epsilon": run["epsilon"]}

    straight = build()
    steps(straight, 2)
    common = {"accountant": straight["accountant"], "sampler": straight["sampler"]}
    save_sharded_checkpoint(
        directory,
        step=2,
        model=straight["model"],
        optimizer=straight["opt"],
        clip_state=straight["state"],
        **common,
    )
    steps(straight, 1)
    resumed = build()
    ckpt = load_sharded_checkpoint(
        directory,
        model=resumed["model"],
        optimizer=resumed["opt"],
        accountant=resumed["accountant"],
        sampler=resumed["sampler"],
    )
    resumed["state"] = ckpt.clip_state
    loaded = {n: t.clone() for n, t in gather_full_params(resumed["model"]).items()}
    steps(resumed, 1)
    grads, _ = straight["fn"](ids[:2], state=straight["state"])
    straight["opt"].accumulate(grads)  # pending, un-noised: never saved
    try:
        save_sharded_checkpoint(
            directory.with_name("pending"),
            step=3,
            model=straight["model"],
            optimizer=straight["opt"],
            **common,
        )
        refused = None
    except OperationError as err:
        refused = str(err)
    straight["opt"].zero_grad()
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    torn = torn_save(directory, straight, common, build)
    torn["params_equal"] = all(torch.equal(loaded[n], t) for n, t in torn.pop("params").items())
    return {
        "torn": torn,
        "refused": refused,
        "pending_written": directory.with_name("pending").exists(),
        "straight": result(straight),
        "resumed": result(resumed),
        "step": ckpt.step,
        "files": files,
    }


def torn_save(
    directory: Path, run: dict[str, Any], common: dict[str, Any], build: Any
) -> dict[str, Any]:
    """A second save into ``directory`` (step 3) whose ``dp.pt`` write fails on rank 0 (a
    full disk): every rank raises, and a fresh run then loads the first save (step 2) whole —
    its own weights, not the second save's shards."""
    import opake.dpsgd.checkpoint as checkpoint_module
    from opake.core.errors import OperationError
    from opake.dpsgd.distributed import (
        gather_full_params,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
    )

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    real = checkpoint_module.save_checkpoint
    checkpoint_module.save_checkpoint = full_disk  # type: ignore[assignment]
    try:
        save_sharded_checkpoint(
            directory, step=3, model=run["model"], optimizer=run["opt"], **common
        )
        error = None
    except OperationError as err:
        error = str(err)
    finally:
        checkpoint_module.save_checkpoint = real
    again = build()
    ckpt = load_sharded_checkpoint(
        directory,
        model=again["model"],
        optimizer=again["opt"],
        accountant=again["accountant"],
        sampler=again["sampler"],
    )
    params = {n: t.clone() for n, t in gather_full_params(again["model"]).items()}
    return {"error": error, "step": ckpt.step, "params": params}


def scenario_resume(rank: int, world_size: int, out: Path) -> None:
    torch.save(resume(rank, world_size, out / "ckpt"), out / f"resume.rank{rank}.pt")


def scenario_adapters(rank: int, world_size: int, out: Path) -> None:
    torch.save(adapters(rank, world_size), out / f"adapters.rank{rank}.pt")


SCENARIOS: dict[str, Callable[[int, int, Path], None]] = {
    "basic": scenario_basic,
    "train": scenario_train,
    "adapters": scenario_adapters,
    "resume": scenario_resume,
}


def main(argv: list[str]) -> int:
    from opake.dpsgd.distributed import init_distributed

    scenario, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    with init_distributed(backend="gloo", timeout=60.0) as ctx:
        try:
            SCENARIOS[scenario](ctx.rank, ctx.world_size, out)
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in destroy_process_group for a rank that is gone
    # the group is destroyed and the output written: skip the interpreter's finalization (a
    # gloo thread torn down during it can abort the process), as _ddp_worker.py does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
