"""The seed's profiling snippets (shared/seeds/memory-optimizations.md) run as written on CPU.

Only the names the snippets take from their surroundings are stand-ins (``device``,
``dataloader``, ``train_step``, ``loss_fn``, ``params``, ``batch_x``, ``batch_y``).
"""

from __future__ import annotations

import pytest
import torch


def test_step_perf_and_perf_state_snippet(capsys):
    device = torch.device("cpu")
    dataloader = [{"input_ids": torch.randint(0, 50, (4, 8))} for _ in range(3)]
    weight = torch.randn(50, 16, requires_grad=True)

    def train_step(batch):
        loss = weight[batch["input_ids"]].pow(2).mean()
        loss.backward()

    # --- snippet: "step_perf + PerfState" ---
    from opake.profiling import PerfState, print_memory, step_perf

    print_memory(device, "start")
    perf_state = PerfState(device=device)

    for batch in dataloader:
        with step_perf(device, batch_size=len(batch["input_ids"])) as perf:
            train_step(batch)
            perf.mark("clip")

        perf_state = perf_state.add(perf.result)
        # e.g., perf.result.step_time_sec, perf.result.memory_peak_gb

    print_memory(device, "end")
    print(perf_state.to_dict(prefix="train/"))
    # --- end of snippet ---

    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[start] cpu")
    assert out[1].startswith("[end] cpu")
    stats = perf_state.to_dict(prefix="train/")
    assert out[2] == str(stats)
    assert stats["train/steps"] == 3
    assert stats["train/samples"] == 12
    assert stats["train/memory_peak_gb_max"] > 0
    assert stats["train/marks/clip_sec"] > 0
    assert perf.result.step_time_sec > 0
    assert perf.result.memory_peak_gb > 0


def test_tuning_workflow_snippet():
    clipping = pytest.importorskip(
        "opake.dpsgd.clipping", reason="clipped_grad comes from opake-core (the [core] extra)"
    )
    assert clipping.clipped_grad is not None
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 3, generator=gen), "b": torch.zeros(3)}
    batch_x = torch.randn(16, 6, generator=gen)
    batch_y = torch.randint(0, 3, (16,), generator=gen)

    def loss_fn(params, x, y):  # one example
        logits = x @ params["w"] + params["b"]
        return torch.nn.functional.cross_entropy(logits, y)

    # --- snippet: "Tuning workflow" ---
    from opake.dpsgd.clipping import clipped_grad
    from opake.profiling import reset_peak_memory, step_perf

    def try_microbatch(candidate_mb: int) -> float:
        grad_fn, clip_state = clipped_grad(
            loss_fn,
            clipping_norm=1.0,
            batch_argnums=(1, 2),
            microbatch_size=candidate_mb,
        )

        reset_peak_memory(device)
        with step_perf(device, batch_size=len(batch_x)) as perf:
            _grads, _aux = grad_fn(params, batch_x, batch_y, state=clip_state)

        return perf.result.memory_peak_gb

    # --- end of snippet ---

    # 1. start with microbatch_size = batch_size, 2. halve ...
    peaks = {m: try_microbatch(m) for m in (16, 8, 4, 2, 1)}
    assert all(isinstance(p, float) and p > 0 for p in peaks.values())
