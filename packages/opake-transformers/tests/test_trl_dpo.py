"""DPDPOTrainer (TRL's DPOTrainer with the DP step) against a hand-written DPTraining step on
both engines, the reference model (a frozen copy, precomputed, LoRA adapters disabled), exact
resume, ε from the accountant, truncation counts and refusals."""

from __future__ import annotations

import importlib.util
import math
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


def _record_rows(record) -> dict[str, torch.Tensor]:
    """One record's two rows (prompt + chosen, prompt + rejected), right-padded, labels -100
    on the prompt and the padding."""
    prompt = record["prompt_ids"]
    rows = [prompt + record["chosen_ids"], prompt + record["rejected_ids"]]
    width = max(map(len, rows))
    ids = torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(row[len(prompt) :])
    return {"input_ids": ids, "labels": labels}


def _hand_written_steps(records, engine: str, steps: int) -> dict[str, torch.Tensor]:
    """DPTraining with DPOLoss, each record accumulated alone; the reference is a frozen copy
    of the initial model, its log-probabilities from plain logits."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.functional import make_functional
    from opake.transformers.losses import DPOLoss, sequence_log_probs

    model, reference = T.model(), T.model().eval()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    dpo = DPOLoss(fmodel, model, beta=T.BETA)
    loss = BatchedLoss(dpo, fmodel)
    training = T.hand_written_training(loss, model, trainable, frozen, engine=engine)
    batches = training.batches()
    for step in range(steps):
        indices = next(batches)
        assert indices
        if step == 0:
            assert indices == [i for chunk in T.first_batch() for i in chunk]
        for index in indices:
            rows = _record_rows(records[index])
            with torch.no_grad():
                logits = reference(input_ids=rows["input_ids"]).logits
                ref = sequence_log_probs(logits, rows["labels"])
            pairs = dpo.prepare(
                trainable,
                frozen,
                rows,
                ref_chosen=ref[:1],
                ref_rejected=ref[1:],
                ids=torch.tensor([index]),
            )
            training.accumulate(pairs.batch, units=pairs.units, records=[index, index])
        training.finish_step()
    return T.params(model)


@pytest.mark.parametrize(
    ("engine", "sampler"), [("bookkeeping", "poisson"), ("vmap", "poisson"), ("vmap", "fixed")]
)
def test_two_steps_equal_a_hand_written_dp_training_loop(tmp_path, engine, sampler, monkeypatch):
    """Fixed shapes: the padding slots' pairs are masked out, both rows of each. Once the
    engine asked for is book-keeping, the pairs are weighed by the clipped forward itself from
    the first physical batch of the run on (no forward without gradient; later physical
    batches of a step take ``prepare``) — the same step as the hand-written loop's
    ``prepare``."""
    from opake.transformers.losses import DPOLoss

    events: list[str] = []
    inner, prepare = DPOLoss._weighed_here, DPOLoss.prepare
    monkeypatch.setattr(
        DPOLoss, "_weighed_here", lambda self, *a: events.append("forward") or inner(self, *a)
    )
    monkeypatch.setattr(
        DPOLoss, "prepare", lambda self, *a, **k: events.append("prepare") or prepare(self, *a, **k)
    )
    trainer = T.dpo_trainer(tmp_path, engine=engine, max_steps=2, dp_sampler=sampler)
    assert trainer.ref_model is not None  # a frozen copy of the initial model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    assert trainer.dp_training.grad_fn.engine == engine
    assert ("forward" in events) == (engine == "bookkeeping")
    assert events[0] == ("forward" if engine == "bookkeeping" else "prepare")
    got = T.params(trainer.model)
    want = _hand_written_steps(trainer.train_dataset, engine, steps=2)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)
    first, second = (h for h in trainer.state.log_history if "loss" in h)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # policy = reference
    assert abs(second["rewards/margins"]) > 1e-5  # the policy moved, the reference did not


def test_a_batch_that_falls_back_to_vmap_is_weighed_first_and_the_step_is_unchanged(
    tmp_path, monkeypatch
):
    """A book-keeping call can fall back to vmap (an inconclusive check), which evaluates rows
    alone: the in-forward weighing then raises, DPTraining drops the pending step (this batch
    only), and the trainer weighs the batch first and clips it again — the same step."""
    from opake.transformers.losses import DPOLoss, PairsNeedBookkeepingError

    calls = []
    inner = DPOLoss._weighed_here

    def once(self, *args):
        calls.append(1)
        if len(calls) == 1:
            raise PairsNeedBookkeepingError("simulated: this call took the vmap engine")
        return inner(self, *args)

    monkeypatch.setattr(DPOLoss, "_weighed_here", once)
    trainer = T.dpo_trainer(tmp_path, engine="bookkeeping", max_steps=2)
    trainer.train()
    assert len(calls) > 1  # the first call tried, fell back and was weighed first; then in forward
    got = T.params(trainer.model)
    want = _hand_written_steps(trainer.train_dataset, "bookkeeping", steps=2)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_precomputed_reference_log_probs_give_the_same_step(tmp_path):
    copy = T.dpo_trainer(tmp_path / "copy", max_steps=2)
    copy.train()
    precomputed = T.dpo_trainer(tmp_path / "pre", precompute_ref_log_probs=True, max_steps=2)
    assert precomputed.ref_model is None  # no reference kept in memory
    assert "ref_chosen_logps" in precomputed.train_dataset.column_names
    precomputed.train()
    want = T.params(copy.model)
    for name, value in T.params(precomputed.model).items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_lora_reference_is_the_model_with_its_adapters_disabled(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig

    from opake.transformers.losses import sequence_log_probs
    from opake.transformers.trl._dpo import PreferenceRows

    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    trainer = T.dpo_trainer(tmp_path, max_steps=2, peft_config=lora)
    assert trainer.ref_model is None  # no second copy
    model = trainer.model
    before = T.params(model)
    trainer.train()
    after = T.params(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed
    assert all("lora_" in n for n in changed)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # LoRA's B starts at zero: on the first step the policy is the base model, the reference
    assert logged[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(logged[-1]["epsilon"])
    # after training, the reference log-probabilities are the base model's, not the policy's
    batch = PreferenceRows(trainer.data_collator)([trainer.train_dataset[i] for i in range(4)])
    mask = batch.pop("opake_attention_mask")
    chosen, rejected = trainer._reference(batch, mask, 4)
    with torch.no_grad():
        policy = sequence_log_probs(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        with model.disable_adapter():
            base = model(input_ids=batch["input_ids"]).logits
    want = sequence_log_probs(base, batch["labels"])
    torch.testing.assert_close(torch.cat([chosen, rejected]), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(policy, want, atol=1e-5, rtol=1e-5)


def test_resume_is_exact_and_epsilon_is_the_accountants(tmp_path):
    T.check_resume_and_epsilon(T.dpo_trainer, tmp_path)


def test_truncation_is_counted(tmp_path):
    data = T.preferences()
    trainer = T.dpo_trainer(tmp_path, data=data, max_length=6)
    counts = trainer.truncation["train"]
    records = trainer.train_dataset
    assert counts.records == len(data)
    assert counts.dropped == len(data) - len(records)
    longer = sum(
        len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) > 6
        for r in records
    )
    assert counts.truncated == longer > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"loss_type": ["ipo"]}, "loss_type=\\['ipo'\\]"),
        ({"sync_ref_model": True}, "sync_ref_model"),
        ({"padding_free": True}, "padding_free=True: it flattens"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"label_smoothing": 0.1}, "label_smoothing"),
        ({"use_weighting": True}, "use_weighting"),
        ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
        ({"max_grad_norm": 1.0}, "max_grad_norm"),
        ({"torch_compile": True}, "torch_compile=True: each pair's two rows"),
    ],
)
def test_options_that_break_dp_are_refused(tmp_path, options, match):
    with pytest.raises(ConfigurationError, match=match):
        T.dpo_trainer(tmp_path, **options)


def test_refusals_outside_the_config(tmp_path):
    from trl import DPOConfig

    from opake.transformers.trl import DPDPOTrainer

    with pytest.raises(InputTypeError, match="DPDPOConfig"):
        DPDPOTrainer(
            model=T.model(),
            ref_model=T.model(),
            args=DPOConfig(str(tmp_path), report_to="none", use_cpu=True),
            train_dataset=T.preferences(),
            processing_class=T.tokenizer(),
        )
    with pytest.raises(ConfigurationError, match="dropout"):
        T.dpo_trainer(tmp_path, model=_with_dropout(), disable_dropout=False)


def _with_dropout():
    model = T.model()
    model.config.attention_dropout = 0.1
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    return model


def test_a_preference_collator_of_ones_own_is_refused(tmp_path):
    """Red-team round 13: a user collator wrapping TRL's and cutting rows to the batch's
    shortest pair was not checked pair by pair (2.21·C measured); only TRL's own is taken."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from opake.transformers.trl import DPDPOTrainer

    tok = T.tokenizer()
    trl_collator = DataCollatorForPreference(pad_token_id=tok.pad_token_id)

    def cutting(features):
        return trl_collator(features)

    for collator, refused in ((cutting, True), (trl_collator, False)):
        build = lambda c=collator: DPDPOTrainer(  # noqa: E731
            model=T.model(),
            args=T.dpo_config(tmp_path),
            train_dataset=T.preferences(),
            processing_class=tok,
            data_collator=c,
        )
        if refused:
            with pytest.raises(ConfigurationError, match="preference collator of your own"):
                build()
        else:
            assert build().data_collator is trl_collator
