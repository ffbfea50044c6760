"""Corpora, blocks, the split, the unigram baseline, the byte tokenizer and the settings."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from opake.cli import ByteTokenizer
from opake.cli._data import Corpus, load_corpus, make_blocks, split_blocks, unigram_entropy
from opake.cli._models import NAMED_MODELS, load_tokenizer, resolve_model
from opake.cli._settings import TrainSettings
from opake.core.errors import ConfigurationError


def test_default_corpus_is_pythons_documentation():
    corpus = load_corpus()
    assert corpus.name == "pydoc"
    assert corpus.num_chars > 100_000
    assert any("for" in doc and "statement" in doc for doc in corpus.documents)
    assert load_corpus("pydoc") == corpus


def test_stdlib_source_corpus():
    corpus = load_corpus("stdlib")
    assert len(corpus.documents) > 100
    assert sum("def " in doc for doc in corpus.documents) > 100


def test_text_and_jsonl_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("héllo\nworld\n", encoding="utf-8")
    assert load_corpus(str(text)).documents == ("héllo\nworld\n",)

    jsonl = tmp_path / "a.jsonl"
    rows = [{"body": "first"}, {"body": "  "}, {"body": "second", "other": 1}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_corpus(str(jsonl), text_field="body").documents == ("first", "second")


@pytest.mark.parametrize(
    ("content", "field", "expected"),
    [
        ('{"text": "ok"}\nnot json\n', "text", "line 2 is not valid JSON"),
        ('{"body": "ok"}\n', "text", "line 1 has no 'text' field"),
        ('["text"]\n', "text", "line 1 has no 'text' field"),
        ('{"text": 3}\n', "text", "is int, expected a string"),
    ],
)
def test_malformed_jsonl_is_refused(tmp_path, content, field, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigurationError, match=expected):
        load_corpus(str(path), text_field=field)


def test_missing_non_utf8_and_directory_data(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigurationError, match="is a directory"):
        load_corpus(str(tmp_path))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        load_corpus(str(latin))


def test_blocks_concatenate_documents_with_separators():
    corpus = Corpus("c", ("ab", "cde", "f"))
    blocks = make_blocks(corpus, list, block_size=4, eos_token_id="|")
    assert blocks == [["a", "b", "|", "c"], ["d", "e", "|", "f"]]  # the tail "|" is dropped
    assert make_blocks(corpus, list, block_size=2, eos_token_id=None) == [
        ["a", "b"],
        ["c", "d"],
        ["e", "f"],
    ]
    with pytest.raises(ConfigurationError):
        make_blocks(corpus, list, block_size=1, eos_token_id=None)


def test_split_is_a_seeded_partition():
    blocks = torch.arange(40).view(20, 2)
    train, val = split_blocks(blocks, val_fraction=0.25, seed=3)
    assert len(train) == 15
    assert len(val) == 5
    rows = sorted(tuple(r) for r in torch.cat([train, val]).tolist())
    assert rows == sorted(tuple(r) for r in blocks.tolist())  # nothing lost or duplicated
    again, _ = split_blocks(blocks, val_fraction=0.25, seed=3)
    other, _ = split_blocks(blocks, val_fraction=0.25, seed=4)
    assert torch.equal(train, again)
    assert not torch.equal(train, other)
    with pytest.raises(ConfigurationError, match="too few"):
        split_blocks(blocks[:1], val_fraction=0.5, seed=0)


def test_unigram_entropy_is_the_empirical_entropy():
    tokens = torch.tensor([1, 1, 1, 2, 3, 3, 7, 7])
    counts = Counter(tokens.tolist())
    expected = -sum(c / 8 * math.log(c / 8) for c in counts.values())
    assert unigram_entropy(tokens, vocab_size=10) == pytest.approx(expected)
    # no distribution over tokens does better on these tokens than their own frequencies
    for probs in (torch.full((10,), 0.1), torch.softmax(torch.randn(10), 0)):
        assert -probs.log()[tokens].mean() >= unigram_entropy(tokens, vocab_size=10)


def test_byte_tokenizer_round_trip_and_save(tmp_path):
    tok = ByteTokenizer()
    text = "DP-SGD — ε ≤ 8 ✓"
    ids = tok.encode(text)
    assert max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids[:2], tok.eos_token_id, *ids[2:]]) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 from a model decodes, replaced
    with pytest.raises(ConfigurationError, match="outside"):
        tok.decode([300])
    tok.save_pretrained(tmp_path)
    assert isinstance(ByteTokenizer.from_pretrained(tmp_path), ByteTokenizer)
    with pytest.raises(ConfigurationError, match="does not exist"):
        ByteTokenizer.from_pretrained(tmp_path / "nothing")
    (tmp_path / "opake_tokenizer.json").write_text('{"kind": "bpe"}')
    with pytest.raises(ConfigurationError, match="expected a byte tokenizer"):
        ByteTokenizer.from_pretrained(tmp_path)


def test_model_resolution(tmp_path):
    assert set(NAMED_MODELS) == {"llama-tiny", "llama-small"}
    with pytest.raises(ConfigurationError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == (str(tmp_path), True)
    with pytest.raises(ConfigurationError, match="has no tokenizer"):  # no silent byte fallback
        load_tokenizer(str(tmp_path))
    ByteTokenizer().save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)


def test_settings_round_trip_and_checks():
    settings = TrainSettings(steps=5, microbatch="auto", lora_r=4)
    assert TrainSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
    with pytest.raises(ConfigurationError, match="unknown keys"):
        TrainSettings.from_dict({**settings.to_dict(), "colour": "red"})
    for bad, message in [
        ({"batch_size": 0}, "--batch-size 0"),
        ({"block_size": 1}, "--block-size 1"),
        ({"lr": float("nan")}, "--lr nan"),
        ({"val_fraction": 1.0}, "--val-fraction"),
        ({"target_epsilon": None}, "give --target-epsilon or --noise-multiplier"),
        ({"precision": "fp8"}, "--precision 'fp8'"),
        ({"engine": "magic"}, "--engine 'magic'"),
        ({"microbatch": 0}, "--microbatch 0"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            TrainSettings(**bad).check()
