"""Data-parallel DP-SGD on real gloo process groups (2 processes on CPU, launched here).

One launch of ``_ddp_worker.py train`` runs every happy-path check in a single process group;
the failure scenarios get their own launches (a failed group cannot be reused). The reference
is computed in this process: the per-example autograd loop (clip, sum, one noise draw from the
same seed, divide by q·N, SGD) and the single-process ``DPOptimizer`` on the global batches.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_ddp_worker.py")
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="this PyTorch build has no gloo backend",
)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up
    spec.loader.exec_module(module)
    return module


W = _load("opake_test_ddp_worker", WORKER)
R = _load("opake_test_ranks", WORKER.with_name("_ranks.py"))  # start workers as torchrun would


def launch(
    scenario: str,
    out: Path,
    *,
    world_size: int = 2,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Start ``world_size`` worker processes (the environment torchrun would set); wait."""
    command = [sys.executable, str(WORKER), scenario, str(out)]
    return list(R.launch(command, world_size=world_size, timeout=timeout, env=env))


def _require_success(ranks: list[Any]) -> None:
    R.require_success(ranks)


@pytest.fixture(scope="module")
def train(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp_train")
    _require_success(launch("train", out))
    return [torch.load(out / f"train.rank{r}.pt", weights_only=False) for r in range(2)]


# -- references ------------------------------------------------------------------------------


def oracle_mlp(steps: int = W.STEPS) -> dict[str, torch.Tensor]:
    """The obvious DP-SGD: per-example autograd loop, clip, sum, noise once, divide, SGD."""
    from opake.core.testing import reference_clipped_grad
    from opake.dpsgd.noise import GaussianNoise
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    fmodel, params = make_functional(W.make_mlp(seed=0))
    params = {n: p.detach().clone() for n, p in params.items()}
    loss_fn = W.mlp_loss(fmodel)
    x, y = W.mlp_data()
    sampler = PoissonSampler(W.N, W.Q, seed=W.SAMPLER_SEED)
    noise = GaussianNoise(W.SIGMA, seed=W.NOISE_SEED)
    for step in range(steps):
        idx = torch.as_tensor(sampler.global_batch(step), dtype=torch.long)
        if len(idx):
            total = reference_clipped_grad(
                loss_fn, (params, x[idx], y[idx]), clipping_norm=W.CLIP, batch_argnums=(1, 2)
            )
        else:
            total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        noisy = noise.add({n: v.float() for n, v in total.items()}, sensitivity=W.CLIP)
        params = {n: p - W.LR * noisy[n] / (W.N * W.Q) for n, p in params.items()}
    return params


@pytest.fixture(scope="module")
def oracle() -> dict[str, torch.Tensor]:
    return oracle_mlp()


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(
            actual[name], want.to(actual[name].dtype), atol=atol, rtol=1e-5, msg=name
        )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# -- the DP step across ranks ----------------------------------------------------------------


def test_two_ranks_equal_the_per_example_oracle(train, oracle):
    # the 2-rank run (shards of the global Poisson batches, accumulation, microbatching,
    # different initial weights on rank 1) ends where the obvious single-process loop ends
    assert _same(train[0]["mlp"]["params"], train[1]["mlp"]["params"])
    _close(train[0]["mlp"]["params"], oracle, atol=2e-6)


def test_two_ranks_equal_the_single_process_optimizer(train):
    single = W.train_mlp(0, 1)
    _close(train[0]["mlp"]["params"], single["params"], atol=2e-6)
    # the accountant saw the global rate on every rank: same ε as the single process
    for rank in train:
        for got, want in zip(rank["mlp"]["reports"], single["reports"], strict=True):
            assert got["sample_rate"] == want["sample_rate"] == W.Q
            assert got["expected_batch_size"] == pytest.approx(W.N * W.Q)
            assert got["epsilon"] == pytest.approx(want["epsilon"], rel=1e-12)
            assert got["sensitivity"] == W.CLIP


def test_shards_partition_the_global_batch_including_empty_shards(train):
    from opake.dpsgd.sampling import PoissonSampler

    sampler = PoissonSampler(W.N, W.Q, seed=W.SAMPLER_SEED)
    global_sizes = [len(sampler.global_batch(t)) for t in range(W.STEPS)]
    local = [train[r]["mlp"]["local_sizes"] for r in range(2)]
    assert [a + b for a, b in zip(*local, strict=True)] == global_sizes
    assert 0 in global_sizes  # a step where both shards are empty (noise only)
    assert any(a > 0 and b == 0 for a, b in zip(*local, strict=True))  # one empty shard
    # every rank accumulated 2 physical batches per step: the report counts all ranks'
    assert [r["physical_batches"] for r in train[0]["mlp"]["reports"]] == [4] * W.STEPS


def test_accumulation_and_microbatching_do_not_change_the_result(train, oracle):
    _close(train[0]["one_chunk"]["params"], oracle, atol=2e-6)
    assert [r["physical_batches"] for r in train[0]["one_chunk"]["reports"]] == [2] * W.STEPS


def test_ddp_wrapped_module_is_reduced_once(train, oracle):
    # DDP's hooks never fire (Opake never back-propagates into the module's parameters) and
    # Opake reduces once: a double reduction would double the sums and miss the oracle
    _close(train[0]["ddp"]["params"], oracle, atol=2e-6)
    assert _same(train[0]["ddp"]["params"], train[1]["ddp"]["params"])


def test_secure_noise_is_drawn_on_rank0_and_broadcast(train):
    assert train[0]["broadcast"]["noise_sync"] == "broadcast"
    assert _same(train[0]["broadcast"]["params"], train[1]["broadcast"]["params"])
    seeded = oracle_mlp(steps=2)
    # fresh OS-entropy noise, not the seeded stream: far from the seeded run
    diff = max(float((train[0]["broadcast"]["params"][n] - seeded[n]).abs().max()) for n in seeded)
    assert diff > 1e-3
    assert train[0]["mlp"]["noise_sync"] == "replicated"


def test_adaptive_clipping_bound_uses_the_count_of_all_ranks(train):
    single = W.train_adaptive(0, 1)
    assert train[0]["adaptive"]["bounds"] == train[1]["adaptive"]["bounds"]
    assert train[0]["adaptive"]["bounds"] == pytest.approx(single["bounds"], rel=1e-9)
    assert len(set(single["bounds"])) == W.STEPS  # the bound really moved every step
    _close(train[0]["adaptive"]["params"], single["params"], atol=2e-6)


def test_adaptive_clipping_without_a_seed_shares_rank_0s_secure_count_noise(train):
    # secure noise (broadcast from rank 0) and an unseeded state: one count noise per step,
    # drawn by rank 0 and broadcast, so every rank keeps the same bound
    bounds = [train[r]["adaptive_secure"]["bounds"] for r in range(2)]
    assert bounds[0] == bounds[1]
    assert len(set(bounds[0])) == W.STEPS


def test_fsdp2_sharded_parameters_equal_the_oracle(train, oracle):
    # FSDP2 (fully_shard) on gloo: parameters and optimizer state sharded at rest, gathered
    # for the per-example step, sums reduce-scattered, each rank adds its rows of one draw
    for rank in train:
        _close(rank["fsdp"]["params"], oracle, atol=2e-6)
        assert [r["physical_batches"] for r in rank["fsdp"]["reports"]] == [4] * W.STEPS
    single = W.train_mlp(0, 1)
    assert [r["epsilon"] for r in train[0]["fsdp"]["reports"]] == pytest.approx(
        [r["epsilon"] for r in single["reports"]], rel=1e-12
    )
    # the 16x8 first-layer weight is split in rows 8 + 8, the 4x16 output layer in 2 + 2
    assert train[0]["fsdp"]["local_shapes"]["0.weight"] == (8, 8)
    assert train[1]["fsdp"]["local_shapes"]["2.weight"] == (2, 16)
    # a sharded state cannot be written by rank 0 alone: refused before any write
    assert "sharded (FSDP2 DTensor) parameters" in train[0]["fsdp"]["checkpoint_refused"]


def test_fsdp2_adam_state_is_sharded_and_matches_single_process(train):
    single = W.train_mlp(0, 1, optim="adam")
    for rank in train:
        _close(rank["fsdp_adam"]["params"], single["params"], atol=2e-6)
    # Adam's moments live on the shards: each rank holds half the rows of every weight
    assert train[0]["fsdp_adam"]["state_shapes"]["0.weight"] == (8, 8)
    assert train[1]["fsdp_adam"]["state_shapes"]["2.weight"] == (2, 16)


def test_fsdp2_secure_noise_is_broadcast_from_rank0(train):
    seeded = oracle_mlp(steps=2)
    for rank in train:
        assert rank["fsdp_secure"]["noise_sync"] == "broadcast"
        params = rank["fsdp_secure"]["params"]
        assert all(bool(torch.isfinite(p).all()) for p in params.values())
        assert max(float((params[n] - seeded[n]).abs().max()) for n in seeded) > 1e-3
    # both ranks gathered the same full parameters: each row got one noise value
    assert _same(train[0]["fsdp_secure"]["params"], train[1]["fsdp_secure"]["params"])


def test_fsdp2_equal_meshes_of_two_sharded_models_are_one_mesh(train):
    # DTensor reuses the mesh object of an earlier fully_shard call for a parameter of a shape
    # it has seen: one mesh, two objects. Compared by equality, it is one mesh.
    for rank in train:
        run = rank["fsdp_two_models"]
        assert run["mesh_objects"] == 2  # the situation arose (else this test proves nothing)
        assert run["error"] is None


def test_tiny_llama_two_ranks_equal_single_process(train):
    single = W.train_llama(0, 1)
    assert _same(train[0]["llama"]["params"], train[1]["llama"]["params"])
    assert sum(train[0]["llama"]["local_sizes"]) + sum(train[1]["llama"]["local_sizes"]) > 0
    _close(train[0]["llama"]["params"], single["params"], atol=1e-5)


# -- misconfiguration raises on every rank, and the group stays usable -------------------------


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("seed", "ConfigurationError", "the noise seed differs"),
        ("shard", "ConfigurationError", "rank 1 has a sampler for shard (0, 2)"),
        ("rate", "ConfigurationError", "expected_batch_size differs"),
        ("replicated_secure", "ConfigurationError", "noise_sync='replicated' with secure"),
        ("idle", "OperationError", "rank(s) [1] accumulated nothing"),
        ("sensitivity", "ConfigurationError", "different sensitivities"),
        ("ddp_keys", "ConfigurationError", "make_functional(unwrap_ddp(model))"),
        ("diverged", "OperationError", "rank(s) [1] do not match rank 0"),
    ],
)
def test_misconfiguration_raises_on_every_rank(train, case, kind, words):
    for rank in train:
        message = rank["errors"][case]
        assert message is not None, f"{case}: nothing raised"
        assert message.startswith(kind + ":"), message
        assert words in message, message
    assert train[0]["errors"]["idle_pending_after"] == "0"


def test_a_rank_that_skips_a_sampler_batch_raises_on_every_rank_before_the_noise(train):
    # finding F3: rank 1's loop consumed one more batch of the sampler than rank 0's, so the
    # step would sum shard_0(t) and shard_1(t + 1), independent draws (an example in both is
    # counted twice: 2·C), accounted as one Poisson step at q. Every rank must refuse it.
    for rank in train:
        drift = rank["drift"]
        for api in ("training", "optimizer"):
            message = drift[api]
            assert message is not None, f"{api}: the drifted step was taken"
            assert message.startswith("OperationError:"), message
            assert "sampler positions differ" in message, message
            assert "rank 0: 1, rank 1: 2" in message, message
            assert "empty ones included" in message, message
        # nothing noised, applied or accounted, and the step was dropped
        assert drift["training_after"] == {
            "steps": 0,
            "accounted": 0,
            "pending": 0,
            "weight_moved": False,
        }
        assert drift["optimizer_after"] == {"steps": 0, "pending": 0}
        # the same look-ahead on every rank (a prefetching DataLoader) is not a drift
        assert drift["lookahead_steps"] == 2


def test_a_step_one_rank_refuses_raises_on_every_rank_before_the_noise(train):
    # DPOptimizer.refuse_step on rank 1 only (DPTraining's "summed more than drawn"): the
    # per-step agreement carries it, so rank 0 raises too instead of waiting in a collective
    for index, rank in enumerate(train):
        message = rank["drift"]["refused"]
        assert message is not None, "the refused step was taken"
        assert message.startswith("ConfigurationError:"), message
        assert "rank(s) [1] refused this step" in message, message
        if index == 1:
            assert "summed 9 examples, drew 4" in message, message
        assert rank["drift"]["refused_after"] == {"steps": 0, "pending": 0}


def test_noise_multipliers_that_differ_across_ranks_raise_on_every_rank(train):
    # red-team round 10: σ changed on one rank only (DPOptimizer.noise_multiplier is settable):
    # replicas noised from one draw at σ and σ/2 reveal the noise; the per-step agreement
    # compares σ and every rank raises before anything is noised
    for rank in train:
        message = rank["drift"]["sigma"]
        assert message is not None, "the step with two noise multipliers was taken"
        assert message.startswith("ConfigurationError:"), message
        assert "noise multipliers differ" in message, message
        assert rank["drift"]["sigma_after"] == {"steps": 0, "pending": 0}


def test_a_resume_refused_on_one_rank_raises_on_every_rank_before_restoring(train):
    # the file (saved with another σ) is visible on rank 0 only: rank 0 refused it while rank 1
    # went on into the loader's collectives, waiting for a rank that had left
    for index, rank in enumerate(train):
        message = rank["lopsided"]["error"]
        assert message is not None, "the refused resume went ahead"
        assert message.startswith("ConfigurationError:"), message
        if index == 0:
            assert "noises with noise_multiplier=0.001" in message, message
        else:
            assert "refused on rank(s) [0]" in message, message
        assert rank["lopsided"]["after"] == {"steps": 0, "accounted": 0}


def test_a_checkpoint_refused_on_one_rank_raises_on_every_rank_before_restoring(train):
    # load_checkpoint_distributed: the file holds an RDP accountant, rank 1 passes a PLD one;
    # rank 0 accepted the file and must neither restore it nor go on training alone
    for index, rank in enumerate(train):
        message = rank["lopsided_components"]["error"]
        assert message is not None, "the refused checkpoint was restored"
        if index == 1:
            assert message.startswith(("CheckpointError:", "ConfigurationError:")), message
            assert "accountant" in message, message
        else:
            assert message.startswith("ConfigurationError:"), message
            assert "refused on rank(s) [1]" in message, message
            assert "nothing was restored" in message, message
        after = rank["lopsided_components"]["after"]
        assert after == {"steps": 0, "accounted": 0, "model_unchanged": True}, after


def test_default_randomness_is_one_secure_key_shared_by_the_ranks(train):
    # noise: a secure key drawn on rank 0 and shared (replicated noise, no broadcast, no seed);
    # sampling: shared_randomness() gives every rank the same global batch
    first = train[0]["secure"]
    for rank in train:
        got = rank["secure"]
        assert got["noise_sync"] == "replicated"
        assert got["noise_secure"] is True
        assert got["noise_key"] == first["noise_key"]
        assert got["sampler_key"] == first["sampler_key"]
        assert got["batch"] == first["batch"]
        # samplers keyed separately on each rank are caught at construction
        assert got["own_keys"] is not None
        assert "the sampler" in got["own_keys"]


# -- the guide's script -----------------------------------------------------------------------


def test_the_guide_training_script_runs_on_two_ranks(train):
    if train[0]["guide"] is None:
        pytest.skip("docs/guide/distributed.md is not in this checkout")
    assert W.guide_script(), "the guide has no '## A training script' python block"
    for rank in train:
        assert rank["guide"]["steps"] == 20
        assert rank["guide"]["checkpoint"]
    assert _same(train[0]["guide"]["params"], train[1]["guide"]["params"])


# -- checkpoint, metrics -----------------------------------------------------------------------


def test_checkpoint_written_by_rank0_restores_every_rank(train):
    for r, rank in enumerate(train):
        ckpt = rank["checkpoint"]
        assert ckpt["step"] == W.STEPS
        assert ckpt["extra"] == {}
        assert ckpt["optimizer_steps"] == W.STEPS
        assert _same(ckpt["params"], train[0]["mlp"]["params"]), f"rank {r}"
        assert ckpt["rng_restored"], f"rank {r} did not get its own RNG state back"


def test_profiling_figures_per_rank_and_aggregated(train):
    if train[0]["metrics"] is None:
        pytest.skip("opake-profiling (step_perf) is not installed in this environment")
    for rank in train:
        step = rank["metrics"]["step"]
        assert [figures["batch_size"] for figures in step] == [3.0, 4.0]
        assert all(figures["step_time_sec"] > 0 for figures in step)
        assert all("memory_peak_gb" in figures for figures in step)
        run = rank["metrics"]["run"]
        assert run["samples/sum"] == 2 * 3 + 2 * 4
        assert run["rank1/samples"] == 8.0
        assert run["steps/max"] == 2.0
        assert run["step_time_sec/max"] >= run["step_time_sec/min"] > 0
    assert train[0]["metrics"] == train[1]["metrics"]


# -- failures ----------------------------------------------------------------------------------


def _no_temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def _assert_fail_fast(
    out: Path, ranks: list[Any], finished_at: float, failing: int, message: str
) -> None:
    other = 1 - failing
    assert ranks[failing].returncode != 0
    assert message in ranks[failing].stderr
    assert ranks[other].returncode != 0
    # the other rank names the failed rank and its error instead of a bare transport error
    err = ranks[other].stderr
    assert f"OperationError: rank {failing} (" in err, err[-3000:]
    assert message in err
    assert not (out / f"finished.rank{other}").exists()
    # fast: far below the 60 s collective timeout of the process group
    entered = float((out / f"entered.rank{other}").read_text())
    assert finished_at - entered < 30.0


@pytest.mark.slow
def test_failing_rank_stops_the_others_and_leaves_the_checkpoint_intact(tmp_path):
    from opake.dpsgd.checkpoint import load_checkpoint

    ranks = launch("fail", tmp_path)
    finished = time.time()
    assert (tmp_path / "saved.rank0").exists(), ranks[0].stderr[-3000:]
    _assert_fail_fast(
        tmp_path, ranks, finished, 1, "ValueError: injected failure on rank 1 before the checkpoint"
    )
    # rank 0 was inside save_checkpoint_distributed when rank 1 failed: it wrote nothing, the
    # step-1 checkpoint is intact and loads, and no temporary file is left behind
    assert load_checkpoint(tmp_path / "ckpt.pt", model=W.make_mlp(), strict=False).step == 1
    assert _no_temp_files(tmp_path) == []


@pytest.mark.slow
def test_failing_rank0_mid_step_stops_the_others(tmp_path):
    # rank 0 also hosts the rendezvous store here: its failure must still be reported
    ranks = launch("fail_step", tmp_path)
    _assert_fail_fast(tmp_path, ranks, time.time(), 0, "ValueError: injected failure on rank 0")


@pytest.mark.slow
def test_stuck_rank_times_out_and_is_aborted(tmp_path):
    from opake.dpsgd.distributed import ABORT_EXIT_CODE

    ranks = launch("hang", tmp_path, env={"OPAKE_TEST_TIMEOUT": "3"}, timeout=100)
    finished = time.time()
    # rank 0's collective hit the 3 s timeout: a clear error, not a hang
    assert ranks[0].returncode == 1, ranks[0].stderr[-3000:]
    assert "no rank had reported an error" in ranks[0].stderr
    # rank 1, stuck in a 120 s sleep, was ended by the watchdog after the 2 s grace
    assert ranks[1].returncode == ABORT_EXIT_CODE, ranks[1].stderr[-3000:]
    assert "aborting the process" in ranks[1].stderr
    assert finished - float((tmp_path / "stuck.rank1").read_text()) < 60.0


@pytest.mark.slow
def test_torchrun_launch_matches_the_oracle(tmp_path, oracle):
    env = R.rank_env(0, 1, 0)
    for name in R.LAUNCHER_VARS:
        env.pop(name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={R.free_port()}",
            str(WORKER),
            "small",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [torch.load(tmp_path / f"small.rank{r}.pt", weights_only=False) for r in range(2)]
    assert _same(results[0]["params"], results[1]["params"])
    _close(results[0]["params"], oracle, atol=2e-6)
