"""Two gloo ranks under the Trainer's own distributed setup = one process (same updates, same ε)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

WORKER = Path(__file__).with_name("_hf_ddp_worker.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="this PyTorch build has no gloo backend",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(out: Path, world_size: int = 2, timeout: float = 240.0) -> None:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))
        }
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    failures = []
    try:
        for rank, proc in enumerate(procs):
            _, stderr = proc.communicate(timeout=timeout)
            if proc.returncode:
                failures.append(f"--- rank {rank} exited {proc.returncode}:\n{stderr[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not failures, "\n".join(failures)


def test_two_gloo_ranks_equal_one_process(tmp_path):
    from opake.transformers import DPTrainer

    _launch(tmp_path)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["world_size"] == 2
    single = DPTrainer(
        model=H.tiny_causal_lm(),
        args=H.dp_args(tmp_path / "single", max_steps=2),
        train_dataset=H.token_data(),
    )
    single.train()
    for name, value in H.params(single.model).items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert result["epsilon"] == pytest.approx(single.dp_training.epsilon(), rel=1e-12)
