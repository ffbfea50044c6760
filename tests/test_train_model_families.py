"""``opake train --model DIR`` on every model family added for transformers 5.x.

Each family's tiny model (its ``tiny_config``, with the byte tokenizer's vocabulary) is saved
with ``save_pretrained`` next to an Opake byte tokenizer, and the command trains it for one DP
step (patched, loss-only head, the engine ``auto`` picks) and evaluates it.
"""

from __future__ import annotations

import json

import pytest

from opake.cli import ByteTokenizer, main
from opake.models.testing import tiny_model

FAMILIES = [
    "gemma3",
    "cohere2",
    "glm4",
    "smollm3",
    "olmo3",
    "ministral",
    "exaone4",
    "mixtral",
    "qwen3_moe",
    "mellum",
    "gpt_oss",
    "hunyuan_v1_moe",
    "qwen3_next",
    "deepseek_v4",
]
#: DeepSeek-V4's top-k indexer gets no gradient from the loss (the engine says so: freeze it
#: under DP) and scatters in place without a vmap batching rule (PyTorch says so)
DEEPSEEK = [
    pytest.mark.filterwarnings("ignore:clipped_grad. the loss does not depend on differentiated"),
    pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:3000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=DEEPSEEK) if f == "deepseek_v4" else f for f in FAMILIES],
)
def test_opake_train_runs_a_saved_tiny_model(family, corpus, tmp_path):
    model_dir = tmp_path / "model"
    tiny_model(family, vocab_size=ByteTokenizer.vocab_size + 7).save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        str(model_dir),
        "--data",
        str(corpus),
        "--block-size",
        "8",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--eval-every",
        "1",
        "--max-val-blocks",
        "2",
        "--no-progress",
        "--out",
        str(out),
    ]
    if family == "deepseek_v4":  # the training step names the indexer's parameters
        from opake.core.errors import OpakePrivacyWarning

        # the check waits for a non-empty Poisson batch (q ≈ 0.006 here: a secure draw is empty
        # one time in seven), so draw a seeded one that is not empty
        argv += ["--reproducible", "--seed", "3"]

        with pytest.warns(OpakePrivacyWarning, match="without gradient.*indexer"):
            assert main(argv) == 0
    else:
        assert main(argv) == 0
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["model_type"] == tiny_model(family).config.model_type
