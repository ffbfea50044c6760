"""``opake train --privacy-unit FIELD``: blocks per unit, sampling and ε per unit, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from opake import accounting
from opake.cli import _trainer as trainer
from opake.cli import main
from opake.cli._data import Corpus, load_corpus
from opake.cli._units import split_units, unit_blocks


@pytest.fixture
def user_records(small_corpus, tmp_path):
    """The small corpus's paragraphs as records of 9 authors (unevenly many each)."""
    paragraphs = [p for p in small_corpus.read_text().split("\n\n") if p.strip()]
    path = tmp_path / "records.jsonl"
    lines = [json.dumps({"author": f"a{(i * i) % 9}", "text": p}) for i, p in enumerate(paragraphs)]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_blocks_never_mix_units_and_validation_holds_out_whole_units(user_records):
    corpus = load_corpus(str(user_records), unit_field="author")
    assert corpus.units is not None
    assert len(corpus.units) == len(corpus.documents)
    cut = unit_blocks(corpus, lambda t: list(t.encode()), block_size=16, eos_token_id=0)
    # every block is a slice of one author's concatenated records
    streams: dict[str, bytes] = {}
    for doc, unit in zip(corpus.documents, corpus.units, strict=True):
        streams[unit] = streams.get(unit, b"") + doc.encode() + b"\0"
    for row, unit in zip(cut.rows, cut.units, strict=True):
        assert bytes(row) in streams[unit]
    blocks = torch.tensor(cut.rows)
    train, val, units = split_units(blocks, cut.units, val_fraction=0.2, seed=0)
    held = {u for u in cut.units if u not in units}
    assert held
    assert train.shape[0] + val.shape[0] == blocks.shape[0]
    assert val.shape[0] == sum(cut.units.count(u) for u in held)


def test_a_run_samples_units_and_reports_epsilon_per_unit(tiny_args, tmp_path, user_records):
    out = tmp_path / "run"
    argv = tiny_args(
        "--data",
        str(user_records),
        "--privacy-unit",
        "author",
        "--max-records-per-unit",
        "4",
        "--batch-size",
        "3",
        "--steps",
        "3",
        out=out,
    )
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    units = summary["units"]
    assert 2 <= units < 9  # whole authors held out for validation
    assert "author" in summary["privacy_unit"]
    assert summary["sample_rate"] == pytest.approx(3 / units)
    assert summary["delta"] == pytest.approx(1 / units**2)
    assert summary["expected_batch_size"] == pytest.approx(3.0)
    assert summary["epsilon"] == pytest.approx(
        accounting.epsilon(
            sample_rate=3 / units,
            noise_multiplier=summary["noise_multiplier"],
            steps=3,
            delta=1 / units**2,
            accountant_options=trainer.PLD_OPTIONS,
        ),
        rel=1e-9,
    )
    assert summary["settings"]["privacy_unit"] == "author"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--max-records-per-unit", "2"), "without --privacy-unit"),
        (("--privacy-unit", "author"), "needs a JSONL file"),
        (("--privacy-unit", "author", "--sampler", "fixed"), "use --sampler poisson"),
        (("--privacy-unit", "author", "--max-records-per-unit", "0"), "expected an integer >= 1"),
    ],
)
def test_bad_unit_options_fail_in_one_line(tiny_args, capsys, extra, expected):
    assert main(tiny_args(*extra)) == 2
    assert expected in capsys.readouterr().err


def test_a_record_without_its_unit_is_refused(tiny_args, tmp_path, capsys, user_records):
    lines = user_records.read_text().splitlines()
    lines[3] = json.dumps({"text": "no author here"})
    user_records.write_text("\n".join(lines))
    argv = tiny_args("--data", str(user_records), "--privacy-unit", "author")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "line 4 has no 'author' field" in err


def test_more_units_per_step_than_units_is_refused(tiny_args, capsys, user_records):
    argv = tiny_args("--data", str(user_records), "--privacy-unit", "author", "--batch-size", "9")
    assert main(argv) == 2
    assert "units (author)" in capsys.readouterr().err


def test_the_audit_refuses_privacy_units_with_gradient_canaries(capsys):
    assert main(["audit", "--privacy-unit", "author"]) == 2
    assert "pass --canaries input" in capsys.readouterr().err


def test_a_corpus_of_units_keeps_each_records_unit():
    corpus = Corpus("x", ("ab", "c", "de"), ("s:u", "s:v", "s:u"))
    cut = unit_blocks(corpus, list, block_size=2, eos_token_id=None)
    assert cut.rows == [["a", "b"], ["d", "e"]]
    assert cut.units == ["s:u", "s:u"]
    assert cut.dropped == 1  # v has one token


@pytest.mark.slow
def test_a_resumed_unit_run_equals_an_uninterrupted_one(
    tiny_args, tmp_path, user_records, monkeypatch
):
    from safetensors.torch import load_file

    extra = (
        "--data",
        str(user_records),
        "--privacy-unit",
        "author",
        "--max-records-per-unit",
        "3",
        "--batch-size",
        "3",
        "--checkpoint-every",
        "1",
        "--reproducible",
    )
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main(tiny_args(*extra, out=full)) == 0
    real = trainer._lr_at

    def stop_at_two(step, **kwargs):
        if step == 2:
            raise KeyboardInterrupt
        return real(step, **kwargs)

    monkeypatch.setattr(trainer, "_lr_at", stop_at_two)
    assert main(tiny_args(*extra, out=parts)) == 130
    monkeypatch.undo()
    assert main(tiny_args(*extra, "--resume", out=parts)) == 0
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((parts / "summary.json").read_text())
    assert b["resumed_from_step"] == 2
    assert a["epsilon"] == b["epsilon"]
    wa = load_file(str(full / "model" / "model.safetensors"))
    wb = load_file(str(parts / "model" / "model.safetensors"))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
