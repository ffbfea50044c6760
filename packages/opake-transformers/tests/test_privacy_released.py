"""What DP trainers let the Trainer release besides the model (an independent review's finds).

The Trainer's ``total_flos`` grew with each physical batch's padded token count and was written
into every checkpoint: its differences gave each Poisson batch's size and the steps a long
record was drawn in (the review identified them all, with no false positive).
``EarlyStoppingCallback`` (and ``load_best_model_at_end``, refused with the arguments in
``test_dp_trainer.py``) chose the released model by an un-noised evaluation metric.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from opake.core.errors import ConfigurationError

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_no_flop_count_reaches_checkpoints_or_metrics(tmp_path: Path) -> None:
    from opake.transformers import DPTrainer

    trainer = DPTrainer(
        model=H.tiny_causal_lm(),
        args=H.dp_args(tmp_path, save_strategy="steps", save_steps=1),
        train_dataset=H.token_data(),
    )
    metrics = trainer.train().metrics
    assert metrics["total_flos"] == 0
    assert trainer.state.total_flos == 0
    saved = sorted(tmp_path.glob("checkpoint-*/trainer_state.json"))
    assert saved
    for state in saved:
        assert json.loads(state.read_text())["total_flos"] == 0


def test_early_stopping_is_refused_however_it_is_given(tmp_path: Path) -> None:
    from transformers import EarlyStoppingCallback

    from opake.transformers import DPTrainer

    def build(**kwargs: object) -> DPTrainer:
        return DPTrainer(
            model=H.tiny_causal_lm(), args=H.dp_args(tmp_path), train_dataset=H.token_data(),
            **kwargs,
        )  # fmt: skip

    for given in (EarlyStoppingCallback, EarlyStoppingCallback(early_stopping_patience=1)):
        with pytest.raises(ConfigurationError, match="un-noised evaluation metric"):
            build(callbacks=[given])
    trainer = build()
    with pytest.raises(ConfigurationError, match="EarlyStoppingCallback"):
        trainer.add_callback(EarlyStoppingCallback())
