"""Sharded checkpoints that do not hang together are refused on every rank, restoring nothing.

Found by an independent review: each rank read the checkpoint directory on its own, so a rank
could resume another run's ``dp.pt`` (both ranks then trained one model from two runs with two
noise seeds, and ε covered one of them) or a shard file of another step dropped into the folder
(the model then held an update the accountant never counted); and a load refused for rewinding
a secure noise source had already put the old weights back. 2 gloo processes on CPU
(``_sharded_tamper_worker.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_sharded_tamper_worker.py")
pytestmark = [
    pytest.mark.slow,  # two fresh interpreters importing torch
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="this PyTorch build has no gloo backend",
    ),
]


def _ranks() -> Any:
    spec = importlib.util.spec_from_file_location("opake_test_ranks", WORKER.with_name("_ranks.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tampered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_tamper")
    R = _ranks()
    R.require_success(R.launch([sys.executable, str(WORKER), "tamper", str(out)], world_size=2,
                               timeout=240.0))  # fmt: skip
    return [torch.load(out / f"tamper.rank{r}.pt", weights_only=False) for r in range(2)]


def test_ranks_reading_two_runs_dp_files_are_refused(tampered: list[dict[str, Any]]) -> None:
    for rank in tampered:
        found = rank["mixed"]
        assert found["error"] is not None
        assert "read different dp.pt files" in found["error"]
        assert not found["changed"]
        assert found["steps"][0] == found["steps"][1]


def test_a_shard_file_of_another_step_is_refused(tampered: list[dict[str, Any]]) -> None:
    for rank in tampered:
        found = rank["swapped"]
        assert found["error"] is not None
        assert "is not the file saved with this dp.pt" in (found["error"])
        assert not found["changed"]
        assert found["steps"][0] == found["steps"][1]


def test_a_refused_rewind_restores_nothing(tampered: list[dict[str, Any]]) -> None:
    for rank in tampered:
        found = rank["rewound"]
        assert found["error"] is not None
        assert "again" in found["error"]
        assert not found["changed"]
        assert found["steps"][0] == found["steps"][1]


def test_an_untouched_checkpoint_still_loads(tampered: list[dict[str, Any]]) -> None:
    for rank in tampered:
        found = rank["whole"]
        assert found["error"] is None
        assert found["changed"]
        assert found["steps"] == (0, 2)
