"""DPTrainer with ``privacy_unit_column``: user-level DP through the Hugging Face Trainer."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from opake import accounting
from opake.core.errors import ConfigurationError

_spec = importlib.util.spec_from_file_location(
    "_trl_helpers", Path(__file__).with_name("_trl_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)
H = T.H  # the Trainer helpers (the TRL helpers build on them)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

USERS = 10  # 40 records of 6 users, unevenly (3..11 records), interleaved


def _data():
    rows = H.token_data()
    for i, row in enumerate(rows):
        row["user"] = f"u{(i * i // 3 + i) % USERS}"
    return rows


def _trainer(tmp_path, data, **options):
    from opake.transformers import DPTrainer

    args = H.dp_args(tmp_path, privacy_unit_column="user", per_device_train_batch_size=2, **options)
    return DPTrainer(model=H.tiny_causal_lm(), args=args, train_dataset=data)


def test_a_step_samples_users_and_equals_the_composition(tmp_path):
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional
    from opake.transformers import DPDataCollator
    from opake.transformers._losses import per_example_losses
    from opake.transformers._sampling import split_units

    data = _data()
    trainer = _trainer(tmp_path, data, max_steps=1, max_records_per_unit=3)
    trainer.train()
    dp = trainer.dp_training
    users = sorted({row["user"] for row in data})
    assert dp.privacy_unit == "unit"
    assert dp.dataset_size == len(users)
    assert dp.sample_rate == pytest.approx(2 * H.ACCUM / len(users))
    got = H.params(trainer.model)

    # the composition driven by hand: same units, same seed, whole units per physical batch
    keys = [row["user"] for row in data]
    model = H.tiny_causal_lm()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    loss = BatchedLoss(per_example_losses(fmodel, model, task="causal_lm"), fmodel)
    training = DPTraining(
        loss,
        torch.optim.SGD(model.parameters(), lr=H.LR),
        trainable,
        args=(frozen,),
        dataset_size=len(data),
        expected_batch_size=2 * H.ACCUM,
        noise_multiplier=H.SIGMA,
        delta=1.0 / len(users) ** 2,
        clipping_norm=H.CLIP,
        randomness="different",
        accountant="rdp",
        seed=H.SEED,
        privacy_units=keys,
        max_records_per_unit=3,
    )
    indices = next(training.batches())
    assert len({keys[i] for i in indices}) >= 2
    per_user: dict[str, int] = {}
    for i in indices:
        per_user[keys[i]] = per_user.get(keys[i], 0) + 1
    assert max(per_user.values()) <= 3  # the cap
    collate = DPDataCollator(pad_token_id=0, causal=True)
    units = training.sampler.units_of(indices).tolist()
    for chunk in split_units(indices, units, H.ACCUM):
        batch = collate([{"input_ids": data[i]["input_ids"]} for i in chunk])
        training.accumulate(batch, records=chunk)
    training.finish_step()
    for name, value in H.params(model).items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_epsilon_is_per_user_at_the_unit_rate(tmp_path):
    data = _data()
    trainer = _trainer(tmp_path, data, max_steps=2)
    trainer.train()
    dp = trainer.dp_training
    users = len({row["user"] for row in data})
    expected = accounting.epsilon(
        sample_rate=2 * H.ACCUM / users,
        noise_multiplier=H.SIGMA,
        steps=2,
        delta=1.0 / users**2,
        accountant="rdp",
    )
    assert dp.epsilon() == pytest.approx(expected, rel=1e-12)
    assert math.isclose(dp.delta, 1.0 / users**2)


def test_physical_batches_cut_at_unit_boundaries_only():
    from opake.transformers._sampling import split_units

    indices = list(range(10))
    units = [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    parts = split_units(indices, units, 3)
    assert [i for part in parts for i in part] == indices
    for part in parts:
        if part:  # no unit in two parts
            inside = {units[i] for i in part}
            others = {units[i] for p in parts if p is not part for i in p}
            assert not inside & others


def test_bad_unit_settings_are_refused(tmp_path):
    data = _data()
    without = [{"input_ids": r["input_ids"]} for r in data]
    with pytest.raises(ConfigurationError, match="no such field"):
        _trainer(tmp_path, without, max_steps=1).train()
    with pytest.raises(ConfigurationError, match="max_records_per_unit"):
        H.dp_args(tmp_path, max_records_per_unit=2)
    with pytest.raises(ConfigurationError, match="Poisson sampling only"):
        _trainer(tmp_path, data, max_steps=1, dp_sampler="fixed").train()


def test_sft_and_dpo_train_per_user(tmp_path):
    data = T.messages()
    data = data.add_column("user", [f"u{i % 5}" for i in range(len(data))])
    per_user = {"privacy_unit_column": "user", "max_steps": 2, "per_device_train_batch_size": 1}
    trainer = T.sft_trainer(tmp_path / "sft", data=data, **per_user)
    trainer.train()
    dp = trainer.dp_training
    assert dp.privacy_unit == "unit"
    assert dp.dataset_size == 5
    assert dp.steps == 2
    pairs = T.preferences()
    pairs = pairs.add_column("user", [f"u{i % 4}" for i in range(len(pairs))])
    dpo = T.dpo_trainer(tmp_path / "dpo", data=pairs, **per_user)
    dpo.train()
    assert dpo.dp_training.privacy_unit == "unit"
    assert dpo.dp_training.dataset_size == 4
    assert dpo.dp_training.steps == 2
