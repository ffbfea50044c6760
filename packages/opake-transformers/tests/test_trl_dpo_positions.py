"""DPDPOTrainer keeps each record's positions its own (red-team review, round 6).

- The reference model runs on whole padded batches (and on TRL's precompute batches): one with
  a length-dependent rotary embedding (``rope_type="dynamic"``) let a long record change the
  reference log-probabilities of every other record of its batch (2.06·C measured). It is
  refused like the policy's.
- A user ``data_collator`` that pads on the left put each record's tokens at positions set by
  the batch's longest record (absolute position embeddings: 2.34·C). ``PreferenceRows`` now
  moves every row's tokens, attention mask and completion mask to position 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opake.core.errors import ConfigurationError

pytest.importorskip("trl")

_spec = importlib.util.spec_from_file_location(
    "_trl_helpers", Path(__file__).with_name("_trl_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)

pytestmark = T.MARKS
_quiet_datasets = T.quiet_datasets

DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


def test_a_reference_model_with_length_dependent_rope_is_refused(tmp_path):
    from opake.core.testing import tiny_llama
    from opake.transformers.trl import DPDPOTrainer

    policy = T.model()
    reference = tiny_llama(
        hidden_size=16,
        num_hidden_layers=1,
        vocab_size=policy.config.vocab_size,
        intermediate_size=32,
        rope_parameters=DYNAMIC,
    )
    with pytest.raises(ConfigurationError, match=r"ref_model.*rope_type='dynamic'"):
        DPDPOTrainer(
            model=policy,
            ref_model=reference,
            args=T.dpo_config(tmp_path),
            train_dataset=T.preferences(),
            processing_class=T.tokenizer(),
        )


def _rows(pad_left: bool) -> dict[str, torch.Tensor]:
    """Two rows of lengths 3 and 5 (prompt 1 token, then the completion), padded to 5."""
    tokens = [[11, 12, 13], [21, 22, 23, 24, 25]]
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    completion = torch.zeros(2, 5, dtype=torch.long)
    for i, row in enumerate(tokens):
        span = slice(5 - len(row), 5) if pad_left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
        completion[i, span] = 1
        completion[i, span.start] = 0  # the prompt token
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def test_preference_rows_of_a_left_padding_collator_are_right_aligned():
    from opake.transformers.trl._dpo import PreferenceRows

    left = PreferenceRows(lambda features: _rows(pad_left=True))([{}, {}])
    right = PreferenceRows(lambda features: _rows(pad_left=False))([{}, {}])
    assert torch.equal(left["input_ids"], right["input_ids"])
    assert torch.equal(left["labels"], right["labels"])
    assert left["labels"].tolist() == [[-100, 12, 13, -100, -100], [-100, 22, 23, 24, 25]]
    assert set(left) == set(right)
    for key in left:
        assert torch.equal(left[key], right[key]), key
