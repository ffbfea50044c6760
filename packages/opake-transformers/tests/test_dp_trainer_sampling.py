"""DPTrainer trains on its own Poisson batches only: any other training loader, and any batch the
Poisson sampler did not draw, is refused before it is used (the logged ε would not hold)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from opake.core.errors import ConfigurationError, OpakePrivacyWarning

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOADER_REFUSED = "not the loader DPTrainer.get_train_dataloader builds"
BATCH_REFUSED = r"physical batch 1 of DP step 1 "


def _collate():
    from opake.transformers import DPDataCollator

    return DPDataCollator(pad_token_id=0, causal=True)


def _shuffle_sampler(n: int):
    from opake.dpsgd.sampling import ShuffleSampler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpakePrivacyWarning)
        return ShuffleSampler(n, H.PER_DEVICE, seed=0)


# What a subclass's get_train_dataloader returns instead of DPTrainer's loader (``own`` is the
# loader DPTrainer built, ``t`` the trainer), and how the refusal names it.
LOADERS = {
    "shuffled DataLoader": (
        lambda t, own: DataLoader(
            t.train_dataset, batch_size=H.PER_DEVICE, shuffle=True, collate_fn=_collate()
        ),
        "DataLoader(batch_sampler=BatchSampler(RandomSampler))",
    ),
    "sequential DataLoader": (
        lambda t, own: DataLoader(t.train_dataset, batch_size=H.PER_DEVICE, collate_fn=_collate()),
        "DataLoader(batch_sampler=BatchSampler(SequentialSampler))",
    ),
    "custom batch_sampler": (
        lambda t, own: DataLoader(
            t.train_dataset,
            batch_sampler=BatchSampler(RandomSampler(t.train_dataset), H.PER_DEVICE, False),
            collate_fn=_collate(),
        ),
        "DataLoader(batch_sampler=BatchSampler(RandomSampler))",
    ),
    "ShuffleSampler as batch_sampler": (
        lambda t, own: DataLoader(
            t.train_dataset,
            batch_sampler=_shuffle_sampler(len(t.train_dataset)),
            collate_fn=_collate(),
        ),
        "DataLoader(batch_sampler=ShuffleSampler)",
    ),
    "the Trainer's own loader": (
        lambda t, own: _trainer_loader(t),
        "DataLoaderShard(batch_sampler=BatchSampler(",  # accelerate's shard of it
    ),
    "DPTrainer's loader, prepared by accelerate": (
        lambda t, own: t.accelerator.prepare(own),
        "DataLoaderShard(batch_sampler=PoissonBatches)",
    ),
    "DPTrainer's loader, batch sampler swapped": (
        lambda t, own: _swapped(own, BatchSampler(SequentialSampler(own.dataset), 4, False)),
        "DataLoader(batch_sampler=BatchSampler(SequentialSampler))",
    ),
}


def _trainer_loader(trainer):
    from transformers import Trainer

    trainer.data_collator = _collate()
    return Trainer.get_train_dataloader(trainer)


def _swapped(loader, batch_sampler):
    # DataLoader refuses setting batch_sampler after construction; bypass that as a user might
    loader.__dict__["batch_sampler"] = batch_sampler
    return loader


def _trainer(tmp_path, replace=None, *, cls=None, **options):
    from opake.transformers import DPTrainer

    if cls is None:

        class Replaced(DPTrainer):
            def get_train_dataloader(self):
                own = super().get_train_dataloader()
                return own if replace is None else replace(self, own)

        cls = Replaced
    options.setdefault("max_steps", 2)
    return cls(
        model=H.tiny_causal_lm(), args=H.dp_args(tmp_path, **options), train_dataset=H.token_data()
    )


def _refused(trainer, match):
    before = H.params(trainer.model)
    with pytest.raises(ConfigurationError, match=match) as err:
        trainer.train()
    assert "\n" not in str(err.value)
    assert trainer.dp_training.steps == 0  # nothing noised, nothing accounted
    after = H.params(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    return str(err.value)


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
@pytest.mark.parametrize("name", list(LOADERS))
def test_a_training_loader_not_built_by_dptrainer_is_refused(tmp_path, name, mode):
    replace, described = LOADERS[name]
    message = _refused(_trainer(tmp_path, replace, dp_sampler=mode), LOADER_REFUSED)
    assert f"was given {described}" in message
    assert f"dp_sampler={mode!r}" in message
    assert "do not override get_train_dataloader" in message
    assert "DPTrainingArguments(dp_sampler=" in message


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_a_sampler_swapped_inside_dptrainers_batch_sampler_is_refused(tmp_path, mode):
    def shuffle_inside(trainer, own):
        own.batch_sampler._sampler = lambda: _shuffle_sampler(len(trainer.train_dataset))
        return own

    _refused(_trainer(tmp_path, shuffle_inside, dp_sampler=mode), "got sampler=ShuffleSampler")


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_another_poisson_draw_inside_dptrainers_loader_is_refused(tmp_path, mode):
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler

    def other_draw(trainer, own):
        def sampler():
            mine = trainer.dp_training.sampler
            if mode == "fixed":
                return FixedShapePoissonSampler(
                    H.N, mine.sample_rate, mine.max_batch_size, seed=H.SEED + 1
                )
            return PoissonSampler(H.N, mine.sample_rate, seed=H.SEED + 1)

        own.batch_sampler._sampler = sampler
        return own

    message = _refused(_trainer(tmp_path, other_draw, dp_sampler=mode), BATCH_REFUSED)
    assert "holds other examples than DPTrainer's" in message


def test_batches_fed_to_the_loop_some_other_way_are_refused(tmp_path):
    from opake.transformers import DPTrainer

    class OwnBatches(DPTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            shuffled = DataLoader(self.train_dataset, batch_size=H.PER_DEVICE, shuffle=True,
                                  collate_fn=_collate())  # fmt: skip
            batches = list(zip(range(num_batches), shuffled, strict=False))
            return [b for _, b in batches], None

    message = _refused(_trainer(tmp_path, cls=OwnBatches), BATCH_REFUSED)
    assert "carries no sampler indices" in message


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_dptrainers_own_loader_still_trains_and_an_override_returning_it_is_accepted(
    tmp_path, mode
):
    from opake.transformers import DPTrainer

    plain = _trainer(tmp_path / "plain", cls=DPTrainer, dp_sampler=mode)
    plain.train()
    passthrough = _trainer(tmp_path / "passthrough", dp_sampler=mode)  # returns super()'s
    passthrough.train()
    assert plain.dp_training.steps == passthrough.dp_training.steps == 2
    after, again = H.params(plain.model), H.params(passthrough.model)
    assert all(torch.equal(after[n], again[n]) for n in after)  # reproducible=True: same run
    assert passthrough.state.log_history[-1]["epsilon"] == plain.dp_training.epsilon() > 0


@pytest.mark.parametrize("given", ["shuffle", "ShuffleSampler"])
def test_dp_sampler_other_than_poisson_or_fixed_is_refused_with_the_reason(tmp_path, given):
    sampler = given if given == "shuffle" else _shuffle_sampler(H.N)
    quoted = repr(given) if given == "shuffle" else given
    with pytest.raises(ConfigurationError, match=f"dp_sampler={quoted}:") as err:
        H.dp_args(tmp_path, dp_sampler=sampler)
    assert "not Poisson sampling" in str(err.value)
