"""opake.dpsgd.distributed in one process: validation, single-process behaviour, aggregation.

The multi-process behaviour (reduction, noise, failures, checkpoints) is tested with real gloo
process groups in test_distributed.py.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd import distributed as D
from opake.dpsgd.clipping import ClippedGrads
from opake.dpsgd.distributed._failure import _is_collective_failure
from opake.dpsgd.optimizer import DPOptimizer

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not torch.distributed.is_initialized()


def _grads(seed: int) -> ClippedGrads:
    gen = torch.Generator().manual_seed(seed)
    return ClippedGrads(
        {"weight": torch.randn(1, 3, generator=gen), "bias": torch.randn(1, generator=gen)},
        max_norm=1.0,
        batch_size=2,
    )


# -- init_distributed / current_context -------------------------------------------------------


def test_without_launcher_is_a_single_process():
    with D.init_distributed(timeout=datetime.timedelta(seconds=5)) as ctx:
        assert (ctx.rank, ctx.world_size, ctx.backend, ctx.timeout_sec) == (0, 1, None, 5.0)
        assert ctx.is_main
        assert not ctx.is_distributed
        ctx.barrier()  # a no-op, not an error
    assert not torch.distributed.is_initialized()
    assert D.current_context().world_size == 1


def test_launcher_without_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="not initialised"):
        D.current_context()
    net = torch.nn.Linear(3, 1)
    with pytest.raises(ConfigurationError, match="WORLD_SIZE=2"):
        D.DistributedDPOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            net,
            noise_multiplier=1.0,
            expected_batch_size=4.0,
            seed=0,
        )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT not set"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "expected 0 ≤ RANK < WORLD_SIZE"),
        ({"WORLD_SIZE": "two"}, "expected an integer"),
        ({"WORLD_SIZE": "-2"}, "expected an int ≥ 0"),
    ],
)
def test_init_distributed_checks_the_environment(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=match):
        D.init_distributed()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "mpi"}, ConfigurationError, "expected one of gloo, nccl"),
        ({"timeout": 0}, ConfigurationError, "finite number of seconds > 0"),
        ({"timeout": float("inf")}, ConfigurationError, "finite number of seconds > 0"),
        ({"timeout": "60"}, InputTypeError, "expected seconds"),
        ({"device": 3.5}, InputTypeError, "expected a torch.device"),
    ],
)
def test_init_distributed_checks_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        D.init_distributed(**kwargs)


def test_nccl_needs_a_cuda_device(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigurationError, match="nccl reduces CUDA tensors only"):
        D.init_distributed(backend="nccl", device="cpu")


# -- DistributedDPOptimizer in one process ----------------------------------------------------


def test_single_process_equals_dp_optimizer():
    nets = [torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)]
    nets[1].load_state_dict(nets[0].state_dict())
    plain = DPOptimizer(
        torch.optim.Adam(nets[0].parameters(), lr=0.1),
        nets[0],
        noise_multiplier=0.8,
        expected_batch_size=4.0,
        seed=3,
    )
    dist_opt = D.DistributedDPOptimizer(
        torch.optim.Adam(nets[1].parameters(), lr=0.1),
        nets[1],
        noise_multiplier=0.8,
        expected_batch_size=4.0,
        seed=3,
    )
    assert (dist_opt.rank, dist_opt.world_size, dist_opt.noise_sync) == (0, 1, "replicated")
    for step in range(3):
        for opt in (plain, dist_opt):
            opt.accumulate(_grads(2 * step))
            opt.accumulate(_grads(2 * step + 1))
        a, b = plain.step(), dist_opt.step()
        assert a == b
    for p, q in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(p, q)
    assert dist_opt.all_reduce_sum(torch.tensor(2.5)) == 2.5


def test_secure_noise_selects_broadcast():
    net = torch.nn.Linear(3, 1)
    opt = D.DistributedDPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        net,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        secure=True,
    )
    assert opt.noise_sync == "broadcast"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"noise_sync": "rank0"}, ConfigurationError, "expected one of auto, replicated"),
        ({"check_sync_every": -1}, ConfigurationError, "expected an int ≥ 0"),
        ({"check_sync_every": 1.5}, ConfigurationError, "expected an int ≥ 0"),
        ({"broadcast_parameters": "yes"}, InputTypeError, "expected a bool"),
        ({"secure": True, "noise_sync": "replicated"}, ConfigurationError, "cannot be replayed"),
    ],
)
def test_distributed_optimizer_checks_arguments(kwargs, error, match):
    net = torch.nn.Linear(3, 1)
    options = {"noise_multiplier": 1.0, "expected_batch_size": 4.0, **kwargs}
    if not options.get("secure"):
        options["seed"] = 0
    with pytest.raises(error, match=match):
        D.DistributedDPOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net, **options)


def test_replicated_noise_needs_a_seeded_noise_object():
    class Unseeded:
        noise_multiplier = 1.0

        def add(self, grads, sensitivity=None):
            return dict(grads)

    net = torch.nn.Linear(3, 1)
    with pytest.raises(ConfigurationError, match="has no seed"):
        D.DistributedDPOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            net,
            noise=Unseeded(),
            expected_batch_size=4.0,
            noise_sync="replicated",
        )


def test_unwrap_and_sync_check_in_one_process():
    net = torch.nn.Linear(2, 2)
    assert D.unwrap_ddp(net) is net
    first = D.check_replicas_in_sync(net)
    second = D.check_replicas_in_sync(dict(net.named_parameters()))
    assert first == second
    with torch.no_grad():
        net.bias[0] += 1e-3
    assert D.check_replicas_in_sync(net) != first
    with pytest.raises(InputTypeError, match=r"expected the nn\.Module"):
        D.check_replicas_in_sync([net.weight])


# -- checkpoints in one process -----------------------------------------------------------------


def test_single_process_checkpoint_round_trip(tmp_path):
    net = torch.nn.Linear(3, 1)
    opt = D.DistributedDPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        net,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=1,
    )
    opt.accumulate(_grads(0))
    with pytest.raises(OperationError, match="never saved"):
        D.save_checkpoint_distributed(tmp_path / "c.pt", step=0, model=net, optimizer=opt)
    opt.step()
    path = tmp_path / "c.pt"
    D.save_checkpoint_distributed(path, step=1, model=net, optimizer=opt, extra={"a": 1})
    other = torch.nn.Linear(3, 1)
    other_opt = D.DistributedDPOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1),
        other,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=1,
    )
    ckpt = D.load_checkpoint_distributed(tmp_path / "c.pt", model=other, optimizer=other_opt)
    assert (ckpt.step, ckpt.extra, other_opt.steps) == (1, {"a": 1}, 1)
    assert torch.equal(other.weight, net.weight)
    with pytest.raises(ConfigurationError, match="reserved"):
        D.save_checkpoint_distributed(
            tmp_path / "d.pt", step=1, model=net, extra={"opake.distributed": 0}
        )


# -- fail_fast in one process -------------------------------------------------------------------


def test_fail_fast_is_transparent_in_one_process():
    with pytest.raises(ValueError, match="boom"), D.fail_fast():
        raise ValueError("boom")
    with D.fail_fast() as guard:
        assert guard.world_size == 1
    assert guard.peer_failure is None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"grace_sec": 0}, ConfigurationError),
        ({"poll_sec": "1"}, InputTypeError),
        ({"exit_code": 0}, ConfigurationError),
        ({"exit_code": 300}, ConfigurationError),
    ],
)
def test_fail_fast_checks_arguments(kwargs, error):
    with pytest.raises(error):
        D.fail_fast(**kwargs)


def test_collective_failures_are_recognised():
    assert _is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed"))
    assert _is_collective_failure(RuntimeError("Timed out waiting 3000ms for recv operation"))
    assert _is_collective_failure(torch.distributed.DistBackendError("NCCL error"))
    assert not _is_collective_failure(RuntimeError("shape mismatch in mat1 @ mat2"))
    assert not _is_collective_failure(ValueError("timed out"))


# -- metrics ------------------------------------------------------------------------------------


def test_rank_metrics_aggregate():
    m = D.RankMetrics(
        (
            {"step_time_sec": 1.0, "memory_peak_gb": 2.0, "samples_per_second": 10.0},
            {"step_time_sec": 2.0, "memory_peak_gb": 3.0},
        )
    )
    agg = m.aggregate()
    assert agg["step_time_sec"] == {"min": 1.0, "max": 2.0, "mean": 1.5, "sum": 3.0}
    assert agg["samples_per_second"]["sum"] == 10.0  # reported by one rank only
    assert m.imbalance() == pytest.approx(2.0 / 1.5)
    flat = m.to_dict(prefix="perf/")
    assert flat["perf/memory_peak_gb/max"] == 3.0
    assert flat["perf/rank1/step_time_sec"] == 2.0
    assert "perf/rank0/step_time_sec" not in m.to_dict(prefix="perf/", per_rank=False)
    with pytest.raises(InputTypeError, match="no rank reported 'loss'"):
        m.imbalance("loss")


def test_gather_metrics_takes_profiling_results():
    profiling = pytest.importorskip("opake.profiling")
    with profiling.step_perf("cpu", batch_size=4) as perf:
        perf.mark("work")
    state = profiling.PerfState(device="cpu").add(perf.result)
    one = D.gather_metrics(perf.result)
    assert one.per_rank[0]["batch_size"] == 4.0
    assert D.gather_metrics(state).per_rank[0]["samples"] == 4.0


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ([1.0], "expected a name -> number dict"),
        ({"t": "fast"}, "expected a number"),
        ({"t": True}, "expected a number"),
        ({1: 1.0}, "expected a str"),
    ],
)
def test_gather_metrics_rejects_bad_input(metrics, match):
    with pytest.raises(InputTypeError, match=match):
        D.gather_metrics(metrics)


# -- FSDP2 helpers in one process (the sharded step itself runs in test_distributed.py) ---------


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.scale = torch.nn.Linear(3, 3)
        self.scale.bias.requires_grad_(False)
        self.register_buffer("offset", torch.arange(3.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.embed(ids)) + self.offset)


def test_compute_template_has_no_parameter_data_and_runs_functionally():
    from opake.functional import make_functional

    model = _Tied()
    template = D.compute_template(model)
    assert all(p.device.type == "meta" for p in template.parameters())
    assert template.head.weight is template.embed.weight  # still tied
    assert not template.scale.bias.requires_grad
    assert torch.equal(template.offset, model.offset)  # buffers are real copies
    assert model.embed.weight.device.type == "cpu"  # the original is untouched
    fmodel, _ = make_functional(template)
    ids = torch.tensor([[0, 3, 4]])
    full = D.gather_full_params(model)
    torch.testing.assert_close(fmodel(full, ids), model(ids))


def test_gather_full_params_of_a_plain_module():
    model = _Tied()
    trainable, frozen = D.gather_full_params(model, partition_trainable=True)
    assert sorted(trainable) == ["embed.weight", "scale.weight"]
    assert sorted(frozen) == ["scale.bias"]
    assert not trainable["embed.weight"].requires_grad
    assert trainable["embed.weight"].data_ptr() == model.embed.weight.data_ptr()
    with pytest.raises(InputTypeError, match=r"expected an nn\.Module"):
        D.gather_full_params({"w": torch.zeros(1)})


def test_compute_template_and_sharded_optimizer_check_their_input():
    with pytest.raises(InputTypeError, match="before fully_shard"):
        D.compute_template({"w": torch.zeros(1)})
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="was not fully_shard-ed"):
        D.ShardedDPOptimizer(opt, net, noise_multiplier=1.0, expected_batch_size=4.0, seed=0)
    with pytest.raises(ConfigurationError, match="not applicable"):
        D.ShardedDPOptimizer(opt, net, broadcast_parameters=False)


def test_make_functional_refuses_a_fully_shard_ed_model(tmp_path):
    """FSDP2's forward swaps in its own gathered parameters: a functional call through it
    would silently ignore the parameters passed (the level-1 trap), so it is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.functional import make_functional

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        make_functional(model)  # before fully_shard: fine
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ConfigurationError, match="compute_template"):
            make_functional(model)
    finally:
        torch.distributed.destroy_process_group()
