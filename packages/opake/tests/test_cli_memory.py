"""The memory-aware default of ``--microbatch`` (issue 29, item 3): without ``--microbatch`` the run
estimates a step's peak from two probe steps and computes the batch in microbatches when a whole
Poisson batch would not fit; the plan says what it chose and why."""

from __future__ import annotations

import json

import pytest

from opake.cli import main
from opake.cli._memory import default_choice, measure_line
from opake.core.errors import ConfigurationError
from opake.profiling import (
    MemoryLine,
    NoMicrobatchFitsError,
    get_memory_stats,
    largest_poisson_batch,
)


def _argv(small_corpus, out, *extra: str) -> list[str]:
    # llama-small with 64-token blocks under the vmap engine: each example computed at once
    # holds its own copy of the gradient (~1.7 MB), so a batch of 32 needs tens of MB more
    # than one example does
    return [
        "train",
        "--model", "llama-small",
        "--data", str(small_corpus),
        "--block-size", "64",
        "--batch-size", "32",
        "--engine", "vmap",
        "--steps", "2",
        "--max-val-blocks", "8",
        "--no-progress",
        "--no-plots",
        "--out", str(out),
        *extra,
    ]  # fmt: skip


def _rss_gb() -> float:
    held = get_memory_stats("cpu").allocated_gb
    assert held is not None
    return held


def test_a_batch_over_the_available_memory_is_microbatched(
    small_corpus, tmp_path, monkeypatch, capsys
):
    # the machine "has" only a few MB beyond what the process holds: half of it is the limit
    mocked: list[float] = []

    def scarce(device):
        mocked.append(2 * (_rss_gb() + 0.02))
        return mocked[-1]

    monkeypatch.setattr("opake.cli._memory.available_memory_gb", scarce)
    out = tmp_path / "run"
    assert main(_argv(small_corpus, out)) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    choice = summary["microbatch_choice"]
    m = summary["microbatch_size"]
    assert m is not None
    assert 1 <= m < 32
    assert m & (m - 1) == 0  # a power of two below the batch
    assert choice["limit_gb"] == pytest.approx(mocked[0] / 2)
    estimate = choice["estimate"]
    assert estimate["per_example_gb"] > 0
    whole = estimate["base_gb"] + estimate["per_example_gb"] * largest_poisson_batch(
        32, 32 / 85, 85
    )
    assert whole > choice["limit_gb"]
    # the plan says what it chose and why
    (line,) = [ln for ln in err.splitlines() if ln.startswith("memory ")]
    assert f"--microbatch auto → {m}: a whole Poisson batch" in line
    assert f"more than half of the {mocked[0]:.1f} GB available" in line
    assert line.split("memory", 1)[1].strip() == choice["reason"]


def test_a_batch_that_fits_runs_whole(small_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("opake.cli._memory.available_memory_gb", lambda device: 1e6)
    out = tmp_path / "run"
    assert main(_argv(small_corpus, out)) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["microbatch_size"] is None
    assert "memory    whole batch at once: a Poisson batch of up to " in err
    assert "within half of the 1000000.0 GB available" in err


def test_a_stated_budget_decides(small_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(small_corpus, out, "--memory-budget", "0.001")) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["microbatch_size"] == 1
    assert "more than --memory-budget 0.001 GB" in err
    assert "even one example at a time is estimated above the limit" in err


def test_a_given_microbatch_is_not_estimated(small_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(small_corpus, out, "--microbatch", "4")) == 0
    assert "memory " not in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["microbatch_size"] == 4
    assert summary["microbatch_choice"]["estimate"] is None


def test_auto_tunes_only_sizes_the_estimate_fits(small_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        "opake.cli._memory.available_memory_gb", lambda device: (_rss_gb() + 0.03) / 0.8
    )
    out = tmp_path / "run"
    assert main(_argv(small_corpus, out, "--microbatch", "auto")) == 0
    err = capsys.readouterr().err
    table = (out / "microbatch_tuning.txt").read_text()
    assert "\n        32  " not in table  # the whole batch was never tried
    assert "sizes above" in err
    assert "skipped" in err


LINE = MemoryLine(base_gb=1.0, per_example_gb=0.125, probes=((1, 1.125), (16, 3.0)))


@pytest.mark.parametrize(
    ("budget", "expected", "sized"),
    [(100.0, None, None), (3.0, 16, "within the budget"), (1.5, 4, "within the budget")],
)
def test_a_stated_budget_sizes_the_chunks(budget, expected, sized):
    choice = default_choice(
        LINE, budget_gb=budget, available_gb=None, expected_batch=16, largest=40
    )
    assert choice.microbatch == expected
    assert choice.limit_gb == budget
    assert choice.line is LINE
    if sized is None:
        assert choice.reason.startswith("whole batch at once: a Poisson batch of up to 40")
    else:
        assert choice.reason.startswith(f"--microbatch auto → {expected}: ")
        assert f"more than --memory-budget {budget:g} GB" in choice.reason
        assert sized in choice.reason


def test_without_a_budget_chunks_use_half_of_the_room_above_the_model():
    # limit: half of 8 GB = 4 GB; chunks: 1 + (4 - 1) / 2 = 2.5 GB -> 12 examples -> 8
    choice = default_choice(LINE, budget_gb=None, available_gb=8.0, expected_batch=16, largest=40)
    assert choice.microbatch == 8
    assert choice.limit_gb == 4.0
    assert "more than half of the 8.0 GB available (4.00 GB)" in choice.reason
    assert "using half of the room above the model" in choice.reason
    assert choice.to_dict()["estimate"] == LINE.to_dict()


def test_a_device_without_free_memory_runs_the_whole_batch():
    choice = default_choice(LINE, budget_gb=None, available_gb=None, expected_batch=16, largest=40)
    assert choice.microbatch is None
    assert "reports no free memory" in choice.reason


def test_one_block_that_does_not_fit_names_the_options(monkeypatch):
    def no_room(*args, **kwargs):
        raise NoMicrobatchFitsError("no microbatch size fits on cpu: even 1 gave oom", None)

    monkeypatch.setattr("opake.cli._memory.measure_memory_line", no_room)
    with pytest.raises(ConfigurationError, match=r"one example of 64 tokens .* --block-size"):
        measure_line(lambda m: None, (), block_size=64, vocab=10, largest=8, device="cpu")


def test_bad_memory_budget_is_one_line(small_corpus, tmp_path, capsys):
    assert main(_argv(small_corpus, tmp_path / "run", "--memory-budget", "0")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "opake train: error: --memory-budget 0.0: expected a finite number > 0"
