"""DPSFTTrainer (TRL's SFTTrainer with the DP step) against a hand-written DPTraining step,
exact resume, ε from the accountant, completion-only labels, truncation counts, refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError

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


@pytest.mark.parametrize("engine", ["bookkeeping", "vmap"])
def test_one_step_equals_a_hand_written_dp_training_step(tmp_path, engine):
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.functional import make_functional
    from opake.transformers.losses import completion_losses

    trainer = T.sft_trainer(tmp_path, engine=engine)
    seen = []
    original = trainer.training_step

    def spy(model, inputs, num_items_in_batch=None):
        seen.append({k: v.clone() for k, v in inputs.items()})
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = spy
    trainer.train()
    assert trainer.dp_training.grad_fn.engine == engine
    got = T.params(trainer.model)
    records = trainer.train_dataset

    # each collated row trains on its record's assistant tokens only (-100 elsewhere)
    for batch in seen:
        for row, index in enumerate(batch["opake_batch_indices"].tolist()):
            labels = records[index]["labels"]
            assert batch["labels"][row, : len(labels)].tolist() == labels
            assert bool((batch["labels"][row, len(labels) :] == -100).all())

    model = T.model()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss = BatchedLoss(completion_losses(fmodel, model), fmodel)
    training = T.hand_written_training(loss, model, trainable, frozen)
    chunks = T.first_batch()
    assert [i for c in chunks for i in c] == next(training.batches())
    assert sum(map(len, chunks)) > 0
    for index in [i for c in chunks for i in c]:  # each record alone, unpadded
        row = records[index]
        training.accumulate(
            {
                "input_ids": torch.tensor(row["input_ids"])[None],
                "labels": torch.tensor(row["labels"])[None],
            }
        )
    training.finish_step()
    for name, value in T.params(model).items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_conversations_without_assistant_only_loss_are_warned_about(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="opake.transformers"):
        trainer = T.sft_trainer(tmp_path, assistant_only_loss=False)
    assert "set assistant_only_loss=True" in caplog.text
    record = trainer.train_dataset[0]
    assert record["labels"] == record["input_ids"]  # TRL's default: every token a target


def test_prompt_completion_records_are_labelled_on_the_completion_only(tmp_path):
    tok = T.tokenizer()
    data = T.prompt_completion()
    trainer = T.sft_trainer(tmp_path, data=data, assistant_only_loss=False)
    for index in range(len(data)):
        record = trainer.train_dataset[index]
        prompt = len(tok(data[index]["prompt"])["input_ids"])
        completion = tok(data[index]["completion"])["input_ids"] + [tok.eos_token_id]
        assert record["labels"][:prompt] == [-100] * prompt
        assert record["labels"][prompt:] == completion


def test_loss_only_head_of_a_patched_model_gives_the_same_step(tmp_path):
    pytest.importorskip("opake.patches")
    from opake.patches import apply_model_patches

    plain = T.sft_trainer(tmp_path / "plain")
    plain.train()
    model = T.model()
    apply_model_patches(model)
    patched = T.sft_trainer(tmp_path / "patched", model=model)
    assert patched.uses_loss_only
    assert not plain.uses_loss_only
    patched.train()
    want = T.params(plain.model)
    for name, value in T.params(patched.model).items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_lora_trains_only_the_adapters(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig

    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    trainer = T.sft_trainer(tmp_path, peft_config=lora)
    before = T.params(trainer.model)
    trainer.train()
    after = T.params(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed
    assert all("lora_" in n for n in changed)


def test_resume_is_exact_and_epsilon_is_the_accountants(tmp_path):
    T.check_resume_and_epsilon(T.sft_trainer, tmp_path)


def test_truncation_is_counted_and_reported(tmp_path, caplog):
    data = T.messages()
    tok = T.tokenizer()
    lengths = [
        len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
        for r in data
    ]
    limit = 7  # a user turn of 4 words fills it: that record has no target token left
    with caplog.at_level("WARNING", logger="opake.transformers"):
        trainer = T.sft_trainer(tmp_path, data=data, max_length=limit)
    counts = trainer.truncation["train"]
    assert counts.records == len(data)
    assert counts.dropped == len(data) - len(trainer.train_dataset)
    assert counts.truncated + counts.dropped == sum(n > limit for n in lengths)
    assert counts.truncated > 0
    assert counts.dropped > 0
    assert "were truncated" in caplog.text
    assert all(len(r["input_ids"]) <= limit for r in trainer.train_dataset)
    trainer.train()
    summary = trainer.state.log_history[-1]
    assert (summary["truncated_records"], summary["dropped_records"]) == (
        counts.truncated,
        counts.dropped,
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"packing": True}, "packing=True: it packs several records into one row"),
        ({"padding_free": True}, "padding_free=True: it flattens"),
        ({"loss_type": "dft"}, "loss_type='dft'"),
        ({"activation_offloading": True}, "activation_offloading"),
        ({"fp16": True}, "fp16"),
        ({"max_grad_norm": 1.0}, "max_grad_norm"),
    ],
)
def test_options_that_break_dp_are_refused(tmp_path, options, match):
    with pytest.raises(ConfigurationError, match=match):
        T.sft_trainer(tmp_path, **options)


@pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning")
def test_torch_compile_steps_equal_the_eager_steps_in_one_graph(tmp_path, monkeypatch):
    """TRL's collated rows padded to the longest record: one graph (traced by Dynamo and run as
    captured, without Inductor: see test_dp_trainer_compile.py)."""
    torch._dynamo.reset()
    graphs = T.H.count_compiled_graphs(monkeypatch)
    eager = T.sft_trainer(tmp_path / "eager", max_steps=2)
    eager.train()
    compiled = T.sft_trainer(tmp_path / "compiled", max_steps=2, torch_compile=True)
    compiled.train()
    torch._dynamo.reset()
    assert compiled.dp_training.compiled
    assert len(graphs) == 1
    want = T.params(eager.model)
    for name, value in T.params(compiled.model).items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_refusals_outside_the_config(tmp_path):
    from trl import SFTConfig

    from opake.transformers.trl import DPSFTTrainer

    with pytest.raises(InputTypeError, match="DPSFTConfig"):
        DPSFTTrainer(
            model=T.model(),
            args=SFTConfig(str(tmp_path), report_to="none", use_cpu=True),
            train_dataset=T.messages(),
            processing_class=T.tokenizer(),
        )
    with pytest.raises(ConfigurationError, match="per_example_loss"):
        DPSFTTrainer(model=T.model(), args=T.sft_config(tmp_path), per_example_loss=len)
    with pytest.raises(ConfigurationError, match="keyword arguments only"):
        DPSFTTrainer(T.model(), T.sft_config(tmp_path))


def test_without_trl_the_names_say_how_to_install_it(monkeypatch):
    import sys

    import opake.transformers.trl as facade

    for name in ["trl", *[m for m in sys.modules if m.startswith("trl.")]]:
        monkeypatch.setitem(sys.modules, name, None)  # importing TRL fails as if not installed
    for name in [m for m in sys.modules if m.startswith("opake.transformers.trl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(vars(facade), "DPSFTTrainer", raising=False)
    with pytest.raises(ConfigurationError, match=r"pip install 'opake-transformers\[trl\]'"):
        _ = facade.DPSFTTrainer
