"""What per-layer sharded compute accepts, checked in one process (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.distributed.sharded._plan import refuse_batch_statistics, sharded_plan


def test_a_batch_norm_with_batch_statistics_is_refused_it_mixes_the_examples() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    with pytest.raises(ConfigurationError, match=r"1 \(BatchNorm1d\).*mixes the examples"):
        sharded_plan(net, ["0.weight", "2.weight"])
    net[1].eval()  # running statistics: per example
    plan = sharded_plan(net, ["0.weight", "2.weight"])
    assert [layer.rule for layer in plan.layers] == ["linear", "linear"]
    refuse_batch_statistics(net)
    net[1].train()  # switched back after a first call: checked at every call, not cached
    with pytest.raises(ConfigurationError, match=r"1 \(BatchNorm1d\).*mixes the examples"):
        refuse_batch_statistics(net)


def test_a_batch_norm_in_eval_mode_without_running_statistics_is_refused() -> None:
    norm = torch.nn.BatchNorm1d(4, track_running_stats=False).eval()  # batch statistics
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), norm, torch.nn.Linear(4, 1))
    with pytest.raises(ConfigurationError, match=r"1 \(BatchNorm1d\).*batch statistics"):
        sharded_plan(net, ["0.weight", "2.weight"])


def test_a_layer_without_a_closed_form_rule_is_refused_by_name() -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    with pytest.raises(ConfigurationError, match=r"no book-keeping rule for .*Scale"):
        sharded_plan(torch.nn.Sequential(torch.nn.Linear(2, 2), Scale()), ["1.weight"])
