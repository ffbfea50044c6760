"""Resume equivalence: a run resumed from a checkpoint continues bit for bit.

The training loop below uses every stateful piece: a Poisson sampler, dropout drawn from the
global RNG, adaptive clipping (its bound and seeded count noise), two physical batches per
logical step, Adam, seeded Gaussian noise and an RDP accountant. The resumed run is built
with *different* seeds and initial weights, so everything it continues with must come from the
checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from opake.dpsgd.checkpoint import load_checkpoint, save_checkpoint

TRAINING = """
import torch
import torch.nn.functional as F

from opake.accounting import RDPAccountant, gradient_noise_multiplier
from opake.dpsgd.clipping import AdaptiveClipping, clipped_grad
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.sampling import PoissonSampler
from opake.functional import make_functional

N, Q, SIGMA_B = 48, 0.125, 3.0


def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Dropout(0.25), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).train()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(tr, fr, x, y):
        return F.cross_entropy(fmodel((tr, fr), x[None]), y[None])

    clip = AdaptiveClipping(
        0.5, count_noise_multiplier=SIGMA_B, expected_batch_size=N * Q, seed=seed
    )
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(2, 3), randomness="different",
        check_unused=False,
    )
    sampler = PoissonSampler(N, Q, seed=seed)
    accountant = RDPAccountant()
    optimizer = DPOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), trainable,
        noise_multiplier=gradient_noise_multiplier(1.0, count_noise_multiplier=SIGMA_B),
        sampler=sampler, accountant=accountant, count_noise_multiplier=SIGMA_B, seed=seed,
    )
    return {
        "model": model, "trainable": trainable, "frozen": frozen, "grad_fn": grad_fn,
        "state": state, "sampler": sampler, "accountant": accountant, "optimizer": optimizer,
    }


def train(run, steps):
    x, y = data()
    batches = iter(run["sampler"])
    for _ in range(steps):
        idx = torch.tensor(next(batches), dtype=torch.long)
        half = idx.shape[0] // 2
        chunks = [
            (run["frozen"], x[idx[:half]], y[idx[:half]]),
            (run["frozen"], x[idx[half:]], y[idx[half:]]),
        ]
        _, run["state"] = run["optimizer"].logical_step(
            run["grad_fn"], run["trainable"], chunks, state=run["state"]
        )


def checkpoint_parts(run):
    return {
        "model": run["model"], "optimizer": run["optimizer"], "accountant": run["accountant"],
        "sampler": run["sampler"],
    }


def summary(run):
    return {
        "params": {k: v.tolist() for k, v in run["model"].state_dict().items()},
        "clip_state": run["state"].to_dict(),
        "accountant": run["accountant"].state_dict(),
        "sampler": run["sampler"].state_dict(),
        "steps": run["optimizer"].steps,
        "noise_calls": run["optimizer"].noise.calls,
        "epsilon": run["accountant"].get_epsilon(1e-5),
    }
"""

RESUME_IN_CHILD = """
import json, sys
from opake.dpsgd.checkpoint import load_checkpoint

namespace = {}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), namespace)
run = namespace["build"](seed=1234)
ckpt = load_checkpoint(sys.argv[2], **namespace["checkpoint_parts"](run))
run["state"] = ckpt.clip_state
namespace["train"](run, int(sys.argv[3]))
json.dump(namespace["summary"](run), open(sys.argv[4], "w"))
"""


def _namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(TRAINING, "<training>", "exec"), namespace)
    return namespace


def _uninterrupted(ns: dict[str, Any], before: int, after: int) -> dict[str, Any]:
    run = ns["build"](seed=5)
    ns["train"](run, before + after)
    return run


def _interrupted(ns: dict[str, Any], path: Path, before: int) -> None:
    run = ns["build"](seed=5)
    ns["train"](run, before)
    save_checkpoint(
        path, step=run["optimizer"].steps, clip_state=run["state"], **ns["checkpoint_parts"](run)
    )


def test_resumed_run_is_bitwise_identical_in_process(tmp_path: Path) -> None:
    ns = _namespace()
    path = tmp_path / "run.pt"
    _interrupted(ns, path, before=3)
    torch.manual_seed(777)  # disturb the global RNG: the checkpoint must restore it
    resumed = ns["build"](seed=1234)
    ckpt = load_checkpoint(path, **ns["checkpoint_parts"](resumed))
    assert ckpt.step == 3
    resumed["state"] = ckpt.clip_state
    ns["train"](resumed, 1)  # the very next step
    reference = _uninterrupted(ns, 3, 1)
    for (name, a), (_, b) in zip(
        resumed["model"].state_dict().items(), reference["model"].state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert ns["summary"](resumed) == ns["summary"](reference)


def test_resume_without_the_rng_state_diverges(tmp_path: Path) -> None:
    # the equivalence above is not vacuous: dropout really draws from the restored global RNG
    ns = _namespace()
    path = tmp_path / "run.pt"
    _interrupted(ns, path, before=3)
    torch.manual_seed(777)
    resumed = ns["build"](seed=1234)
    resumed["state"] = load_checkpoint(
        path, rng=False, **ns["checkpoint_parts"](resumed)
    ).clip_state
    ns["train"](resumed, 1)
    reference = _uninterrupted(ns, 3, 1)
    assert not torch.equal(resumed["model"][0].weight, reference["model"][0].weight)


@pytest.mark.slow
def test_resumed_run_in_a_fresh_process_is_bitwise_identical(tmp_path: Path) -> None:
    ns = _namespace()
    path = tmp_path / "run.pt"
    _interrupted(ns, path, before=2)
    script = tmp_path / "training.py"
    script.write_text(TRAINING)
    out = tmp_path / "summary.json"
    subprocess.run(
        [sys.executable, "-c", RESUME_IN_CHILD, str(script), str(path), "3", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    child = json.loads(out.read_text())
    reference = json.loads(json.dumps(ns["summary"](_uninterrupted(ns, 2, 3))))
    assert child["steps"] == 5
    assert child["noise_calls"] == 5
    assert child == reference  # parameters as exact float lists, accountant, sampler, clip state
