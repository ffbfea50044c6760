"""The HF guide (docs/guide/hf-trainer.md) says what DPTrainer refuses, as the installed
transformers has it."""

from __future__ import annotations

from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "hf-trainer.md"


def _refused_section() -> str:
    if not GUIDE.is_file():
        pytest.skip("the guide is not part of this checkout")
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index("## What is refused, and why")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_every_refused_setting_is_a_setting_of_the_installed_transformers():
    from transformers import TrainingArguments

    from opake.transformers._refusals import _REFUSED, refused_settings

    names = refused_settings()
    assert names
    assert all(hasattr(TrainingArguments, name) for name in names)
    gone = [name for name, _, _ in _REFUSED if not hasattr(TrainingArguments, name)]
    assert not set(gone) & set(names)


def test_the_guide_names_every_refused_setting_and_no_missing_one_as_refused():
    from transformers import TrainingArguments

    from opake.transformers._refusals import _REFUSED, refused_settings

    section = _refused_section()
    spelled = {
        "fp16": "`fp16`",
        "max_grad_norm": "`max_grad_norm",
        "auto_find_batch_size": "`auto_find_batch_size`",
        "dataloader_drop_last": "`dataloader_drop_last`",
        "train_sampling_strategy": "`train_sampling_strategy`",
        "deepspeed": "DeepSpeed",
        "fsdp": "FSDP",
        "neftune_noise_alpha": "NEFTune",
        "n_gpu": "DataParallel",
        "group_by_length": "`group_by_length`",
        "include_num_input_tokens_seen": "`include_num_input_tokens_seen`",
        "load_best_model_at_end": "`load_best_model_at_end`",
    }
    assert set(spelled) == {name for name, _, _ in _REFUSED}
    for name in refused_settings():
        assert spelled[name] in section, name
    for name, _, _ in _REFUSED:
        if not hasattr(TrainingArguments, name):  # named only as "where transformers has it"
            at = section.index(spelled[name])
            assert "still has" in section[max(0, at - 80) : at], name
