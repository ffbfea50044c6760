"""``opake train`` on ordinary models and ordinary mistakes.

Dropout models (stock GPT-2 and BERT configs) train under both engine settings; a read-only
``--out``, a block longer than the model's context and a tokenizer larger than the vocabulary
fail in one line before the plan; a diverging run warns; an ε below the target is explained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opake.cli import main


def _save(config, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from opake.cli import ByteTokenizer

    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    ByteTokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    from transformers import GPT2Config

    # stock GPT-2 dropout (resid/embd/attn 0.1), tiny sizes; the byte tokenizer needs 257 ids
    config = GPT2Config(
        vocab_size=260, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return _save(config, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=260,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        is_decoder=True,  # BertLMHeadModel: BERT-style blocks, default dropout 0.1
    )
    return _save(config, tmp_path_factory.mktemp("bert"))


@pytest.mark.parametrize(("which", "engine"), [("gpt2", "vmap"), ("bert", "auto")])
def test_dropout_models_train_with_dropout_active(
    which, engine, gpt2_dir, bert_dir, tiny_args, tmp_path, capsys
):
    directory = gpt2_dir if which == "gpt2" else bert_dir
    out = tmp_path / "run"
    argv = tiny_args(
        "--no-plots", "--model", str(directory), "--steps", "2", "--engine", engine, out=out
    )
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "dropout stays active" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clipping_engine"] == "vmap"
    assert summary["steps"] == 2


def test_dropout_with_explicit_bookkeeping_is_refused_and_no_dropout_opts_out(
    gpt2_dir, tiny_args, tmp_path, capsys
):
    argv = tiny_args(
        "--no-plots", "--model", str(gpt2_dir), "--engine", "bookkeeping", out=tmp_path / "a"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "dropout" in err[0]
    out = tmp_path / "b"
    argv = tiny_args(
        "--no-plots", "--model", str(gpt2_dir), "--steps", "1", "--no-dropout", out=out
    )
    assert main(argv) == 0
    assert "dropout switched off" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["clipping_engine"] == "bookkeeping"


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    # (a library's logging may add its own lines to the captured stream: count the command's)
    lines = [line for line in captured.err.splitlines() if line.startswith("opake train")]
    assert len(lines) == 1, captured.err
    assert "privacy" not in captured.err  # refused before the plan is printed
    return lines[0]


def test_block_size_and_vocabulary_are_checked_against_the_model(
    gpt2_dir, tiny_args, tmp_path, capsys
):
    from transformers import GPT2Config

    line = _one_line_error(
        capsys, tiny_args("--no-plots", "--model", str(gpt2_dir), "--block-size", "64")
    )
    assert "exceeds the context" in line
    assert "32 positions" in line
    line = _one_line_error(
        capsys, tiny_args("--no-plots", "--model", "llama-tiny", "--block-size", "4096")
    )
    assert "at most 1024" in line
    config = GPT2Config(
        vocab_size=100, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    small = _save(config, tmp_path / "v")
    line = _one_line_error(capsys, tiny_args("--no-plots", "--model", str(small)))
    assert "vocabulary has 100 entries" in line


def test_read_only_out_fails_in_one_line_before_the_plan(tiny_args, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    target = locked / "run"
    if os.access(locked, os.W_OK):  # root ignores permission bits; sysfs refuses even root
        target = Path("/sys/opake-cli-test-run")
    opake = Path(sys.executable).with_name("opake")
    argv = tiny_args("--no-plots", out=target)
    proc = subprocess.run(
        [str(opake), *argv], capture_output=True, text=True, timeout=300, check=False
    )
    locked.chmod(0o700)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--out" in lines[0]
    assert "cannot write there" in lines[0]
    assert "Traceback" not in proc.stderr


def test_diverging_run_warns(tiny_args, tmp_path, capsys):
    out = tmp_path / "run"
    argv = tiny_args(
        "--no-plots",
        "--steps",
        "6",
        "--eval-every",
        "1",
        "--lr",
        "1e4",
        "--noise-multiplier",
        "1",
        out=out,
    )
    assert main(argv) == 0
    assert "the run is diverging" in capsys.readouterr().err
    notes = json.loads((out / "summary.json").read_text())["notes"]
    assert any("diverging" in note for note in notes)


def test_fixed_sampler_reaches_the_target_epsilon(tiny_args, tmp_path, capsys):
    out = tmp_path / "run"
    argv = tiny_args(
        "--no-plots", "--sampler", "fixed", "--target-epsilon", "8", "--steps", "1", out=out
    )
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    # the truncation term used to cap ε at ln(999) ≈ 6.9 whatever the target
    assert summary["planned_epsilon"] == pytest.approx(8.0, rel=0.01)
    assert summary["epsilon"] <= 8.0 + 1e-9
