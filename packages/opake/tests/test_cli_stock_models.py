"""``opake train --model DIR`` on a stock Hugging Face model as users save one: GPT-2 with its
dropout on and a pad id set (transformers' padding check reads token values, which the
per-example forward under ``vmap`` must not trip over)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opake.cli.__main__ import main
from opake.cli._tokenizer import ByteTokenizer


def _stock_gpt2(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = ByteTokenizer().to_transformers()
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,  # what HF users set (the Trainer does with processing_class=tok)
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_stock_gpt2_with_dropout_and_a_pad_id_trains(tiny_args, tmp_path):
    model = _stock_gpt2(tmp_path / "gpt2")
    out = tmp_path / "run"
    argv = tiny_args("--steps", "2", out=out)
    argv[argv.index("llama-tiny")] = str(model)
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_source"] == str(model)
    assert summary["steps"] == 2
    # dropout draws per-example masks: the vmap engine, as the plan says
    assert summary["clipping_engine"] == "vmap"
