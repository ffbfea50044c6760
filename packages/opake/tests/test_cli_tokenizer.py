"""A run's output directory loads with Hugging Face's own classes (issue 29, item 13): the byte
tokenizer is saved as a ``tokenizers``-backed fast tokenizer with the same ids."""

from __future__ import annotations

import warnings

import pytest

from opake.cli import ByteTokenizer, main

TEXTS = [
    "héllo, wörld",
    "def f(x):\n\treturn x  # ✓",
    " leading and trailing ",
    "日本語 € \x00\x7f",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("tok") / "run"
    argv = [
        "train", "--model", "llama-tiny", "--data", str(small_corpus), "--block-size", "16",
        "--batch-size", "8", "--steps", "2", "--max-val-blocks", "8", "--no-progress",
        "--no-plots", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    return out


def test_auto_tokenizer_loads_the_output_with_the_training_ids(run_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    hf = AutoTokenizer.from_pretrained(str(run_dir / "model"))
    assert isinstance(hf, PreTrainedTokenizerBase)
    assert hf.is_fast
    byte = ByteTokenizer()
    assert len(hf) == byte.vocab_size
    assert hf.eos_token_id == byte.eos_token_id
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == byte.encode(text), text
        assert hf.decode(ids) == text
    # opake train --model on the output still reads the byte tokenizer it trained with
    assert ByteTokenizer.from_pretrained(run_dir / "model").vocab_size == 257


def test_the_output_generates_with_a_pipeline(run_dir):
    from transformers import pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on generation defaults
        generate = pipeline("text-generation", model=str(run_dir / "model"), device="cpu")
        out = generate("def f", max_new_tokens=4, do_sample=False)
    text = out[0]["generated_text"]
    assert text.startswith("def f")
    # four byte tokens at most: each decodes to at most one character (a lone byte that is not
    # valid UTF-8 becomes U+FFFD, three bytes in UTF-8: which bytes come depends on the run's noise)
    assert len(text) <= len("def f") + 4
