"""``opake tune``: the tuner on a tiny model, JSON and plot outputs, one-line errors."""

from __future__ import annotations

import json

import pytest

from opake.cli import main

FAST = ["--batch-size", "4", "--seq-len", "8", "--steps", "1", "--compare-smaller", "1"]


def test_tune_prints_the_table(capsys):
    rc = main(["tune", *FAST, "--budget-gb", "1000"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("opake tune: llama-tiny (")
    # what the header announces is what the steps column counts (issue 29: "3 smoke steps" and 4)
    assert "batch 4 x 8 tokens on cpu, 1 warm-up + 1 timed step(s) per candidate" in lines[0]
    assert lines[1].split()[:2] == ["microbatch", "status"]
    assert lines[3].split()[:3] == ["4", "fits", "2"]
    assert lines[3].endswith("<- chosen")
    assert lines[4].split()[:2] == ["2", "fits"]
    assert "budget 1000.000 GB on process-level peak RSS: microbatch_size=4" in out
    assert "not your data" in out


def test_tune_json_plot_and_candidates(capsys, tmp_path):
    png = tmp_path / "tune.png"
    rc = main(["tune", *FAST, "--candidates", "3,1", "--json", "--plot", str(png)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "llama-tiny"
    assert data["seq_len"] == 8
    assert data["microbatch_size"] == 3
    assert [c["microbatch_size"] for c in data["candidates"]] == [3, 1]
    assert data["memory_process_level"] is True
    assert data["memory_budget_gb"] > 0  # the CPU default budget
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tune_a_local_model_directory(capsys, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320,  # at least the byte tokenizer opake uses without a tokenizer file
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    rc = main(["tune", *FAST, "--model", str(tmp_path / "model"), "--candidates", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"opake tune: {tmp_path / 'model'} (" in out
    assert "microbatch_size=4" in out
    # a directory's model has a fixed number of positions
    rc = main(["tune", *FAST, "--model", str(tmp_path / "model"), "--seq-len", "64"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == "opake tune: error: --seq-len 64: the model takes at most 32 positions"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "--batch-size 0: expected a whole number >= 1"),
        (["--seq-len", "1"], "--seq-len 1: expected a whole number >= 2"),
        (["--budget-gb", "-2"], "--budget-gb -2.0: expected a positive number of GiB"),
        (["--candidates", "8,x"], "--candidates '8,x': expected comma-separated whole numbers"),
        (["--candidates", "16"], "expected sizes between 1 and --batch-size 8"),
        (["--model", "/no/such/dir"], "--model /no/such/dir: not a local directory"),
        (["--device", "tpu"], "--device 'tpu': not a torch device"),
        (["--plot", "out.svg"], "--plot out.svg: expected a file name ending .png"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message):
    rc = main(["tune", "--steps", "1", *argv])
    captured = capsys.readouterr()
    assert rc == 2
    err = captured.err.strip()
    assert err.count("\n") == 0
    assert err.startswith("opake tune: error: ")
    assert message in err


def test_nothing_fits_prints_the_table_and_one_error_line(capsys):
    rc = main(["tune", *FAST, "--candidates", "1", "--budget-gb", "0.000001"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "over budget" in captured.out
    assert "nothing fits" in captured.out
    err = captured.err.strip()
    assert err.count("\n") == 0
    assert err.startswith("opake tune: error: no microbatch size fits on cpu")


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", "--batch-size", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "argument --batch-size: invalid int value: 'many'" in err


def test_train_and_tune_resolve_devices_alike():
    from opake.cli._plan import resolve_device
    from opake.core.errors import ConfigurationError

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto", auto=True).type in {"cpu", "cuda", "mps"}
    with pytest.raises(ConfigurationError, match="not a torch device; expected cpu, cuda"):
        resolve_device("auto")  # opake train has no automatic device
    with pytest.raises(ConfigurationError, match="--device meta: expected cpu, cuda"):
        resolve_device("meta")
    with pytest.raises(ConfigurationError, match="expected auto, cpu, cuda, cuda:N or mps"):
        resolve_device("banana", auto=True)
