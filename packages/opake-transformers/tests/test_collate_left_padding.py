"""A review found that ``DPDataCollator`` kept a base collator's *left* padding: a record's
tokens then sat at positions set by the longest record of its batch, and with absolute position
embeddings (GPT-2) one long record moved every other record's clipped gradient (6.2·C with 16
short records). The collator now moves every row's tokens to the front (``right_aligned``);
this file checks the alignment and, end to end, that adding one long record moves the clipped
sum by at most C.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.core.testing import exact_norm, tiny_gpt2
from opake.transformers._collate import DPDataCollator, right_aligned


def test_left_padded_rows_are_moved_to_the_front_with_every_per_token_tensor():
    batch = {
        "input_ids": torch.tensor([[9, 9, 5, 6], [7, 8, 1, 2]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        "labels": torch.tensor([[-100, -100, 5, 6], [7, 8, 1, 2]]),
        "position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]),
        "scores": torch.tensor([0.5, 0.25]),  # not per token: left alone
    }
    out = right_aligned(batch)
    assert out["input_ids"].tolist() == [[5, 6, 9, 9], [7, 8, 1, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out["labels"].tolist() == [[5, 6, -100, -100], [7, 8, 1, 2]]
    assert out["position_ids"].tolist() == [[0, 1, 1, 1], [0, 1, 2, 3]]
    assert out["scores"] is batch["scores"]
    with pytest.raises(ConfigurationError, match="one contiguous run"):
        right_aligned({"input_ids": torch.ones(1, 3), "attention_mask": torch.tensor([[1, 0, 1]])})


def test_one_long_record_moves_the_clipped_sum_by_at_most_c_with_left_padding():
    from transformers import DataCollatorWithPadding

    from opake.cli import ByteTokenizer
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional
    from opake.transformers._losses import per_example_losses

    warnings.filterwarnings("ignore")
    tok = ByteTokenizer().to_transformers()
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # a common setting of generation-ready tokenizers
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=len(tok), n_positions=256).eval()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    collate = DPDataCollator(
        pad_token_id=tok.pad_token_id, causal=True, base=DataCollatorWithPadding(tok)
    )
    loss = BatchedLoss(per_example_losses(fmodel, model, task="causal_lm"), fmodel)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=2, engine="bookkeeping")
    short = [tok(t) for t in ["the cat sat", "a dog ran", "one two three", "hello world"] * 2]
    long = tok("x" * 120)

    def clipped_sum(features):
        out, _ = grad_fn(trainable, frozen, collate([dict(f) for f in features]), state=state)
        return {k: v.double() for k, v in out.items()}

    with_long, without = clipped_sum([*short, long]), clipped_sum(short)
    moved = exact_norm({k: with_long[k] - without[k] for k in trainable})
    assert moved <= 1.0 + 1e-5, moved


def _padded(features, left: bool):
    """A user collator that pads ``input_ids`` with 0 and returns no attention mask."""
    width = max(len(f["input_ids"]) for f in features)
    rows = []
    for f in features:
        pad = [0] * (width - len(f["input_ids"]))
        rows.append(pad + f["input_ids"] if left else f["input_ids"] + pad)
    return {"input_ids": torch.tensor(rows)}


def test_a_collator_that_pads_on_the_left_without_a_mask_is_refused():
    # a review measured 4.49·C: the padding was neither masked nor moved (round 6)
    features = [{"input_ids": [5, 6]}, {"input_ids": [7, 8, 1, 2]}]
    collator = DPDataCollator(causal=True, base=lambda f: _padded(f, left=True), engine_mask=False)
    with pytest.raises(ConfigurationError, match=r"no attention_mask.*row 0"):
        collator(features)


def test_a_collator_that_pads_on_the_right_without_a_mask_gets_its_records_mask():
    features = [{"input_ids": [5, 6]}, {"input_ids": [7, 8, 1, 2]}]
    collator = DPDataCollator(causal=True, base=lambda f: _padded(f, left=False), engine_mask=False)
    batch = collator(features)
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, -100, -100], [7, 8, 1, 2]]
    same = [{"input_ids": [5, 6]}, {"input_ids": [7, 8]}]
    assert "attention_mask" not in collator(same) or collator(same)["attention_mask"].all()
