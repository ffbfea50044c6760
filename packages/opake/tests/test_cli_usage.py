"""What the command line says about itself: ``--model`` help from one source, errors in the
subcommand's name, a batch-size refusal that explains its numbers (issue 29, items 9 and 10)."""

from __future__ import annotations

import re

import pytest

from opake.cli import main


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


def _model_help(text: str) -> str:
    found = re.search(r"--model MODEL (.*?) --[a-z-]+ [A-Z_]+ ", text)
    assert found, text
    return found.group(1)


@pytest.mark.parametrize("command", ["train", "audit", "tune"])
def test_every_model_option_lists_every_kind_of_source(capsys, command):
    text = _model_help(_help(capsys, command))
    for kind in ("llama-small", "llama-tiny", "Hugging Face model directory", ".gguf", "org/name"):
        assert kind in text, (command, text)


def test_the_model_help_has_one_source_and_tune_says_why_its_default_differs(capsys):
    train, audit, tune = (_model_help(_help(capsys, c)) for c in ("train", "audit", "tune"))
    assert train == audit
    assert "llama-small (default)" in train
    assert "llama-tiny (default; opake train's default is llama-small" in tune
    # apart from which default it names, tune's text is train's
    assert tune.split("; or a pretrained model")[1] == train.split("; or a pretrained model")[1]


def test_an_unknown_option_is_refused_in_the_subcommands_name(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--epsilon", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "opake train: error: unrecognized arguments: --epsilon 0; did you mean "
        "--target-epsilon? (see opake train --help)"
    )


def test_a_batch_larger_than_the_data_says_what_the_numbers_are(tiny_args, tmp_path, capsys):
    argv = tiny_args(out=tmp_path / "run")
    argv[argv.index("--batch-size") + 1] = "5000"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    found = re.search(r"exceeds the (\d+) training blocks", err)
    assert found, err
    n = int(found.group(1))
    said = f"pass a --batch-size of at most {n} (e.g. --batch-size {n // 10}, a tenth of the "
    assert said + "blocks: each step then samples about 10% of the data), or give more data" in err
