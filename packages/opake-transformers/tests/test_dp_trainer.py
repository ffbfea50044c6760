"""DPTrainer against the shared composition, a hand-written step and the per-example loop."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from opake import accounting
from opake.core.errors import ConfigurationError, OperationError

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _trainer(tmp_path, model=None, data=None, **options):
    from opake.transformers import DPTrainer

    model = model if model is not None else H.tiny_causal_lm()
    data = data if data is not None else H.token_data()
    return DPTrainer(model=model, args=H.dp_args(tmp_path, **options), train_dataset=data)


def _first_batch(n: int = H.N) -> list[list[int]]:
    from opake.dpsgd.sampling import PoissonSampler
    from opake.transformers._collate import split

    q = H.PER_DEVICE * H.ACCUM / n
    indices = PoissonSampler(n, q, seed=H.SEED).global_batch(0).tolist()
    return split(indices, H.ACCUM)


def _oracle_step(model, data, chunks, loss_of):
    """Per-example autograd loop on each example *unpadded*, clip, sum (fp64), one noise
    draw from the same seed, / expected batch, SGD."""
    from opake.dpsgd.noise import GaussianNoise

    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named.items()}
    for index in [i for chunk in chunks for i in chunk]:
        grads = torch.autograd.grad(loss_of(model, data[index]), list(named.values()))
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        scale = min(1.0, H.CLIP / float(norm))
        for (name, _), g in zip(named.items(), grads, strict=True):
            total[name] += g.double() * scale
    noisy = GaussianNoise(H.SIGMA, seed=H.SEED).add(
        {n: v.float() for n, v in total.items()}, sensitivity=H.CLIP
    )
    expected = H.PER_DEVICE * H.ACCUM
    return {n: p.detach() - H.LR * noisy[n] / expected for n, p in named.items()}


def _causal_loss(model, row):
    ids = torch.tensor(row["input_ids"])[None]
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _classifier_loss(model, row):
    ids = torch.tensor(row["input_ids"])[None]
    return model(input_ids=ids, labels=torch.tensor([row["labels"]])).loss


def test_one_step_equals_the_composition_the_hand_written_step_and_the_oracle(tmp_path):
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional
    from opake.transformers import DPDataCollator
    from opake.transformers._losses import per_example_losses

    data = H.token_data()
    trainer = _trainer(tmp_path, data=data, max_steps=1)
    trainer.train()
    got = H.params(trainer.model)
    chunks = _first_batch()
    assert sum(map(len, chunks)) > 0
    collate = DPDataCollator(pad_token_id=0, causal=True)

    # the shared composition, driven by hand with the same seeds
    model = H.tiny_causal_lm()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss = BatchedLoss(per_example_losses(fmodel, model, task="causal_lm"), fmodel)
    training = DPTraining(
        loss,
        torch.optim.SGD(model.parameters(), lr=H.LR),
        trainable,
        args=(frozen,),
        dataset_size=H.N,
        expected_batch_size=H.PER_DEVICE * H.ACCUM,
        noise_multiplier=H.SIGMA,
        delta=1.0 / H.N**2,
        clipping_norm=H.CLIP,
        randomness="different",
        accountant="rdp",
        seed=H.SEED,
    )
    assert [i for c in chunks for i in c] == next(training.batches())
    for chunk in chunks:
        training.accumulate(collate([data[i] for i in chunk]))
    training.finish_step()
    for name, value in H.params(model).items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)

    # hand-written: clipped_grad + DPOptimizer
    manual = H.tiny_causal_lm()
    fmodel, trainable, frozen = make_functional(manual, partition_trainable=True)
    loss = BatchedLoss(per_example_losses(fmodel, manual, task="causal_lm"), fmodel)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=H.CLIP, batch_argnums=2, randomness="different", engine="vmap"
    )
    opt = DPOptimizer(
        torch.optim.SGD(manual.parameters(), lr=H.LR),
        manual,
        noise_multiplier=H.SIGMA,
        expected_batch_size=H.PER_DEVICE * H.ACCUM,
        seed=H.SEED,
    )
    for chunk in chunks:
        grads, state = grad_fn(trainable, frozen, collate([data[i] for i in chunk]), state=state)
        opt.accumulate(grads)
    opt.step()
    for name, value in H.params(manual).items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)

    # the obvious reference: each example alone, unpadded
    expected = _oracle_step(H.tiny_causal_lm(), data, chunks, _causal_loss)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_epsilon_is_logged_every_step_and_equals_the_accountant(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    q = H.PER_DEVICE * H.ACCUM / H.N
    for h in logged:
        want = accounting.epsilon(
            sample_rate=q,
            noise_multiplier=H.SIGMA,
            steps=h["step"],
            delta=1.0 / H.N**2,
            accountant="rdp",
        )
        assert h["epsilon"] == pytest.approx(want, rel=1e-12)
        assert h["delta"] == 1.0 / H.N**2
        assert h["noise_multiplier"] == H.SIGMA
        assert h["sample_rate"] == q
        assert "grad_norm" not in h
    assert trainer.state.log_history[-1]["epsilon"] == logged[-1]["epsilon"]


def test_resume_mid_run_equals_the_uninterrupted_run_bitwise(tmp_path):
    full = _trainer(tmp_path / "full", max_steps=4)
    full.train()
    first = _trainer(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "opake_dp_state.pt").is_file()
    resumed = _trainer(tmp_path / "run", model=H.tiny_causal_lm(seed=9), max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.dp_training.steps == 4
    for name, value in H.params(full.model).items():
        assert torch.equal(H.params(resumed.model)[name], value), name
    assert resumed.dp_training.epsilon() == full.dp_training.epsilon()


def test_logged_epoch_after_a_resume_counts_the_steps_before_it(tmp_path):
    """A resumed run logs the same ``epoch`` at each step as the uninterrupted run (the DP
    sampler restores its own position; the Trainer skips no batch to get there)."""
    full = _trainer(tmp_path / "full", max_steps=8, num_train_epochs=2)
    full.train()
    first = _trainer(tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=3)
    first.train()
    resumed = _trainer(tmp_path / "run", max_steps=8)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))

    def epochs(trainer):
        return {h["step"]: h["epoch"] for h in trainer.state.log_history if "loss" in h}

    want = epochs(full)
    assert want[5] == pytest.approx(1.0)  # 40 examples / expected batch 8: 5 steps an epoch
    got = {step: epoch for step, epoch in epochs(resumed).items() if step > 3}
    assert sorted(got) == [4, 5, 6, 7, 8]
    for step, epoch in got.items():
        assert epoch == pytest.approx(want[step]), step
    assert resumed.state.epoch == pytest.approx(full.state.epoch)


def test_resume_from_a_checkpoint_without_dp_state_is_refused(tmp_path):
    first = _trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "opake_dp_state.pt").unlink()
    again = _trainer(tmp_path, max_steps=3)
    with pytest.raises(ConfigurationError, match="privacy already spent"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_target_epsilon_calibrates_sigma_for_the_planned_steps(tmp_path):
    trainer = _trainer(tmp_path, noise_multiplier=None, target_epsilon=4.0, max_steps=3)
    trainer.train()
    q = H.PER_DEVICE * H.ACCUM / H.N
    sigma = accounting.calibrate_noise(
        target_epsilon=4.0, delta=1.0 / H.N**2, sample_rate=q, steps=3, accountant="rdp"
    )
    assert trainer.dp_training.noise_multiplier == pytest.approx(sigma)
    assert trainer.dp_training.epsilon() <= 4.0
    assert trainer.privacy_stop_message is None


def test_training_stops_when_the_budget_is_spent(tmp_path, caplog):
    trainer = _trainer(tmp_path, noise_multiplier=2.0, target_epsilon=1.5, max_steps=50)
    allowed = trainer.args.max_steps
    with caplog.at_level("WARNING", logger="opake.transformers"):
        trainer.train()
    steps = trainer.dp_training.steps
    assert 0 < steps < allowed
    assert trainer.state.global_step == steps
    assert trainer.dp_training.epsilon() <= 1.5
    assert trainer.privacy_stop_message is not None
    assert "privacy budget spent" in caplog.text


def test_lora_trains_only_the_adapters(tmp_path):
    pytest.importorskip("peft")
    from opake.core.testing import with_lora

    model = with_lora(H.tiny_causal_lm(), r=2)
    before = H.params(model)
    trainer = _trainer(tmp_path, model=model, max_steps=2)
    trainer.train()
    after = H.params(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed
    assert all("lora_" in n for n in changed)
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if n not in changed)
    assert math.isfinite(trainer.state.log_history[-1]["epsilon"])


def test_sequence_classification_with_padding_matches_each_example_alone(tmp_path):
    data = H.token_data(labels=True)
    trainer = _trainer(tmp_path, model=H.tiny_classifier(), data=data, max_steps=1)
    trainer.train()
    expected = _oracle_step(H.tiny_classifier(), data, _first_batch(), _classifier_loss)
    got = H.params(trainer.model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_label_smoothing_is_applied_within_each_example(tmp_path):
    import torch.nn.functional as F

    from opake.transformers._losses import _classification

    logits = torch.randn(3, 4)
    labels = torch.tensor([0, 2, 1])
    config = type("C", (), {"num_labels": 4, "problem_type": None})()
    per_example = _classification(logits, labels, config, 0.1)
    for i in range(3):
        alone = F.cross_entropy(logits[i : i + 1], labels[i : i + 1], label_smoothing=0.1)
        torch.testing.assert_close(per_example[i], alone)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"fp16": True}, "fp16"),
        ({"max_grad_norm": 1.0}, "max_grad_norm"),
        ({"dataloader_drop_last": True}, "dataloader_drop_last"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        (
            {"include_num_input_tokens_seen": True},
            "include_num_input_tokens_seen='all'.*batch size",
        ),
        (
            {"include_num_input_tokens_seen": "non_padding"},
            "include_num_input_tokens_seen='non_padding'.*batch size",
        ),
        (
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": True},
            },
            "reentrant",
        ),
        (
            {
                "load_best_model_at_end": True,
                "eval_strategy": "steps",
                "save_strategy": "steps",
                "eval_steps": 1,
                "save_steps": 1,
            },
            "load_best_model_at_end=True.*un-noised evaluation metric",
        ),
    ],
)
def test_features_that_would_break_dp_are_refused(tmp_path, options, match):
    with pytest.raises((ConfigurationError, ValueError), match=match):
        _trainer(tmp_path, **options)


def test_trainer_fsdp_is_refused_with_the_sharded_route(tmp_path):
    # the Trainer's FSDP is refused at construction; the message names the route that works
    with pytest.raises(ConfigurationError, match=r"fsdp=True: .*shard=True.*opake train --shard"):
        _trainer(tmp_path, fsdp="full_shard")


def test_refusals_outside_the_arguments(tmp_path):
    from transformers import TrainingArguments

    from opake.core.errors import InputTypeError
    from opake.transformers import DPTrainer, DPTrainingArguments

    model = H.tiny_causal_lm()
    with pytest.raises(InputTypeError, match="DPTrainingArguments"):
        DPTrainer(model=model, args=TrainingArguments(str(tmp_path), report_to="none"))
    with pytest.raises(ConfigurationError, match="per_example_loss"):
        DPTrainer(
            model=model,
            args=H.dp_args(tmp_path),
            train_dataset=H.token_data(),
            compute_loss_func=lambda *a, **k: 0,
        )

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from H.token_data()

    with pytest.raises(ConfigurationError, match="map-style"):
        DPTrainer(model=model, args=H.dp_args(tmp_path), train_dataset=Stream())
    with pytest.raises(ConfigurationError, match="target_epsilon"):
        DPTrainingArguments(str(tmp_path), report_to="none")
    with pytest.raises(ConfigurationError, match="no per-example loss"):
        DPTrainer(model=torch.nn.Linear(2, 2), args=H.dp_args(tmp_path))
    args = H.dp_args(tmp_path, gradient_checkpointing=True)
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False} or (
        args.gradient_checkpointing_kwargs is None
    )


def test_fixed_shape_sampling_masks_padding_and_accounts_the_truncation(tmp_path):
    seen = []
    trainer = _trainer(tmp_path, dp_sampler="fixed", max_steps=2)
    original = trainer.training_step

    def spy(model, inputs, num_items_in_batch=None):
        seen.append(inputs["opake_example_mask"].clone())
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = spy
    trainer.train()
    dp = trainer.dp_training
    slots = dp.sampler.max_batch_size
    assert slots % H.ACCUM == 0
    assert [int(m.numel()) for m in seen] == [slots // H.ACCUM] * (2 * H.ACCUM)  # one shape
    assert any(not bool(m.all()) for m in seen)  # padding slots were masked out
    q = H.PER_DEVICE * H.ACCUM / H.N
    want = accounting.epsilon(
        sample_rate=q,
        noise_multiplier=H.SIGMA,
        steps=2,
        delta=1.0 / H.N**2,
        accountant="rdp",
        max_batch_size=slots,
        dataset_size=H.N,
    )
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(want, rel=1e-12)


def test_secure_randomness_is_the_default(tmp_path):
    trainer = _trainer(tmp_path, reproducible=False, max_steps=1)
    trainer.train()
    assert trainer.dp_training.secure
    assert trainer.dp_training.sampler.seed is None
    assert trainer.args.reproducible is False


def test_a_second_train_call_is_refused_with_the_way_to_continue(tmp_path):
    # it raised RecursionError (the Trainer's accelerator wrapped the DP step again); a second
    # run on the same data would also spend ε again: refused, saying how to continue
    model = H.tiny_causal_lm()
    trainer = _trainer(tmp_path, model=model, max_steps=2)
    trainer.train()
    spent = trainer.dp_training.epsilon()
    after_first = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OperationError, match="already called on this trainer"):
        trainer.train()
    assert trainer.dp_training.epsilon() == spent  # nothing more was spent
    assert all(torch.equal(after_first[k], v) for k, v in model.state_dict().items())
