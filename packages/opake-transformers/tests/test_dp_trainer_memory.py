"""DPTrainer's memory-aware default microbatch (``microbatch_size`` not set)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opake.core.errors import ConfigurationError

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _trainer(tmp_path, **options):
    from opake.transformers import DPTrainer

    return DPTrainer(
        model=H.tiny_causal_lm(),
        args=H.dp_args(tmp_path, max_steps=1, **options),
        train_dataset=H.token_data(),
    )


def test_a_batch_that_would_not_fit_is_computed_in_microbatches(tmp_path, monkeypatch, caplog):
    """The estimate (1 GB + 1 GB per example) puts a whole physical batch (up to 11 examples)
    over the 3.5 GB budget and 2 examples at a time within it; the step is the same."""
    from opake.profiling import PROBE_EXAMPLES, MemoryLine
    from opake.transformers import _microbatch

    measured = []

    def line(make_grad_fn, params, *, length, vocab, device, largest, batch):
        examples = min(PROBE_EXAMPLES, largest)  # what measure_memory_line probes
        probe = batch(torch.randint(0, vocab, (examples, length)))
        measured.append({k: tuple(v.shape) for k, v in probe.items()})
        return MemoryLine(base_gb=1.0, per_example_gb=1.0)

    monkeypatch.setattr(_microbatch, "measure_memory_line", line)
    chunked = _trainer(tmp_path / "chunked", memory_budget_gb=3.5)
    with caplog.at_level("INFO", logger="opake.transformers"):
        chunked.train()
    # probes: random tokens of the longest example's length (10 tokens), labels for the loss;
    # the larger probe is at most the largest physical batch (11 examples)
    assert measured == [{"input_ids": (11, 10), "labels": (11, 10)}]
    assert chunked.microbatch_choice is not None
    assert chunked.microbatch_choice.microbatch == 2
    assert chunked.dp_training.grad_fn.microbatch_size == 2
    reason = chunked.microbatch_choice.reason
    assert "up to 11 examples" in reason
    assert "memory_budget_gb=3.5" in reason
    assert "privacy-neutral" in reason
    assert reason in caplog.text

    whole = _trainer(tmp_path / "whole", microbatch_size=64)  # one chunk, no estimate
    whole.train()
    assert whole.microbatch_choice is None
    after, want = H.params(chunked.model), H.params(whole.model)
    for name, value in want.items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert chunked.dp_training.epsilon() == whole.dp_training.epsilon()


def test_a_batch_that_fits_runs_whole_measured_by_the_tuner(tmp_path, caplog):
    trainer = _trainer(tmp_path, memory_budget_gb=1000.0)
    with caplog.at_level("INFO", logger="opake.transformers"):
        trainer.train()
    choice = trainer.microbatch_choice
    assert choice is not None
    assert choice.microbatch is None
    assert "whole physical batch at once" in choice.reason
    assert "within memory_budget_gb=1000" in choice.reason
    assert trainer.dp_training.grad_fn.microbatch_size is None
    assert "per-device microbatch" in caplog.text


def test_one_example_that_does_not_fit_is_a_configuration_error(monkeypatch):
    from opake.profiling import NoMicrobatchFitsError
    from opake.transformers import _microbatch

    def no_room(*args, **kwargs):
        raise NoMicrobatchFitsError("no microbatch size fits on cpu: even 1 gave oom", None)

    monkeypatch.setattr(_microbatch, "measure_memory_line", no_room)
    with pytest.raises(ConfigurationError, match="DPTrainer: one training example at a time"):
        _microbatch.measure_line(
            lambda m: None,
            (),
            task="causal_lm",
            model_config=None,
            length=8,
            vocab=16,
            largest=4,
            device=torch.device("cpu"),
        )


@pytest.mark.parametrize(
    ("problem", "num_labels", "shape", "dtype"),
    [
        (None, 3, (2,), torch.long),
        ("regression", 1, (2, 1), torch.float32),
        ("multi_label_classification", 4, (2, 4), torch.float32),
    ],
)
def test_classification_probes_have_the_heads_labels(problem, num_labels, shape, dtype):
    from types import SimpleNamespace

    from opake.transformers._microbatch import probe_batch

    config = SimpleNamespace(num_labels=num_labels, problem_type=problem)
    ids = torch.randint(0, 50, (2, 7))
    probe = probe_batch("sequence_classification", config)(ids)
    assert probe["input_ids"] is ids
    assert tuple(probe["labels"].shape) == shape
    assert probe["labels"].dtype == dtype
    if dtype == torch.long:
        assert int(probe["labels"].max()) < num_labels


@pytest.mark.parametrize("budget", [0, -1.0, "2", True])
def test_a_bad_memory_budget_is_refused(tmp_path, budget):
    with pytest.raises(ConfigurationError, match="memory_budget_gb"):
        H.dp_args(tmp_path, memory_budget_gb=budget)
