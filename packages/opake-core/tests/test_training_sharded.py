"""``DPTraining(..., shard=True)``: per-layer sharded compute (FSDP2 level 2) as one object.

One launch of ``_training_sharded_worker.py`` (2 gloo processes) trains the tiny Llama-like
model of ``_sharded_worker.py`` (blocks, head and root ``fully_shard``-ed) for 3 seeded logical
steps of 2 physical batches each, saving a sharded checkpoint after step 2, and resumes a fresh
run from it for step 3. The reference, computed here: single-process ``DPTraining`` with the
book-keeping engine (same seed: same global Poisson batches, same noise draws). The refusals
that need no process group run in this process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError

HERE = Path(__file__).parent


def _load(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


W = _load("opake_test_training_sharded_worker", "_training_sharded_worker.py")
R = _load("opake_test_ranks", "_ranks.py")  # start workers as torchrun would
M = W.W  # the model of _sharded_worker.py


def _training(**options: Any) -> Any:
    """A single-process DPTraining over the unsharded model (book-keeping engine)."""
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    model = M.make_model()
    fmodel, params = make_functional(model)

    def losses(p: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        return causal_lm_losses(fmodel(p, ids), ids)

    settings: dict[str, Any] = {
        "module": model,
        "dataset_size": M.N,
        "sample_rate": M.Q,
        "noise_multiplier": M.SIGMA,
        "delta": 1e-5,
        "clipping_norm": M.CLIP,
        "accountant": "rdp",
        "microbatch_size": 2,
        "seed": W.SEED,
        "engine": "bookkeeping",
        **options,
    }
    opt = torch.optim.SGD(model.parameters(), lr=M.LR)
    return model, DPTraining(BatchedLoss(losses, fmodel), opt, params, **settings)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"engine": "vmap"}, "engine='vmap'"),
        ({"compile": True}, "compile=True"),
        ({"privacy_units": list(range(16))}, "privacy_units"),
        ({"offload_state": True}, "offload_state"),
        ({"sampler": "fixed"}, "sampler='fixed'"),
        ({"clipping_norm": "adaptive"}, "adaptive clipping"),
        ({}, "no torch.distributed process group"),
    ],
)
def test_what_level_2_does_not_do_is_refused_before_anything_is_built(
    options: dict[str, Any], match: str
) -> None:
    from opake.dpsgd.clipping import AdaptiveClipping

    if options.get("clipping_norm") == "adaptive":
        options = {
            "clipping_norm": AdaptiveClipping(
                1.0, count_noise_multiplier=0.8, expected_batch_size=5, seed=0
            )
        }
    with pytest.raises(ConfigurationError, match=rf"DPTraining\(shard=True\).*{match}"):
        _training(**{"engine": "auto", "shard": True, **options})


def test_shard_must_be_a_bool() -> None:
    with pytest.raises(InputTypeError, match="shard='yes'"):
        _training(shard="yes")


def launch(out: Path, *, world_size: int = 2, timeout: float = 180.0) -> None:
    """Start the ranks (the environment torchrun would set), wait, fail with their stderr."""
    worker = str(HERE / "_training_sharded_worker.py")
    R.require_success(
        R.launch([sys.executable, worker, str(out)], world_size=world_size, timeout=timeout)
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this PyTorch build has no gloo backend")
    out = tmp_path_factory.mktemp("training_sharded")
    launch(out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_sharded_training_equals_single_process_bookkeeping(ranks: list[dict[str, Any]]) -> None:
    model, training = _training()
    W.run(training, W.STEPS)
    want = dict(model.named_parameters())
    assert ranks[0]["sizes"] != ranks[1]["sizes"]  # shards of different sizes: padding ran
    for run in ranks:
        assert run["steps"] == W.STEPS
        assert run["engine"] == "bookkeeping"
        assert "sharded" in run["repr"]
        for name, value in want.items():
            torch.testing.assert_close(run["params"][name], value.detach(), atol=2e-6, rtol=1e-5)
        assert run["epsilon"] == pytest.approx(training.epsilon(), rel=1e-12)


@pytest.mark.slow
def test_sharded_training_resumes_from_its_checkpoint_bit_for_bit(
    ranks: list[dict[str, Any]],
) -> None:
    for run in ranks:
        assert run["resumed_steps_before"] == W.STEPS - 1
        for name, value in run["params"].items():
            assert torch.equal(run["resumed"][name], value), name
        assert run["resumed_epsilon"] == run["epsilon"]


@pytest.mark.slow
def test_a_one_batch_step_reduce_scatters_each_sum_in_grad_fn(
    ranks: list[dict[str, Any]],
) -> None:
    """``DPTraining.step`` (one physical batch) hands the optimizer this rank's rows already
    reduced (one full-size sum alive at a time); ``logical_step`` (two) hands it full sums.
    Same parameters either way (the same noise; the sums' order differs within fp32)."""
    for run in ranks:
        got = run["whole_steps"]
        assert set(got["received_whole"]) == {"ScatteredGrads"}
        assert len(got["received_whole"]) == 2
        assert "ScatteredGrads" not in got["received_halves"]
        assert len(got["received_halves"]) == 4
        for name, value in got["halves"].items():
            torch.testing.assert_close(got["whole"][name], value, atol=2e-6, rtol=1e-5)
        # one training: step() after logical_step() and after a dropped accumulate()
        assert got["received_mixed"] == [
            "ClippedGrads",
            "ClippedGrads",
            "ScatteredGrads",
            "ClippedGrads",
            "ScatteredGrads",
        ]
        assert got["mixed_steps"] == 3


@pytest.mark.slow
def test_sharded_refusals_under_a_process_group(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        assert "not fully_shard-ed" in run["refusals"]["unsharded"]
        assert "save(directory)" in run["refusals"]["state_dict"]
