"""bf16 through DPTrainer (CPU autocast): it trains, its step is the composition's bf16 step,
and what is not supported is refused with a message."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opake.core.errors import ConfigurationError

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: a small σ and a large step, so a bf16 forward visibly moves the update away from fp32's
SIGMA, LR = 0.01, 2.0


def _composition_step(data, autocast):
    """One step of the shared composition (DPTraining) driven by hand with the trainer's seeds;
    returns the parameters after it and each example's loss."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.sampling import PoissonSampler
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional
    from opake.transformers import DPDataCollator
    from opake.transformers._collate import split
    from opake.transformers._losses import per_example_losses

    model = H.tiny_causal_lm()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    losses = per_example_losses(fmodel, model, task="causal_lm", autocast=autocast)
    training = DPTraining(
        BatchedLoss(losses, fmodel),
        torch.optim.SGD(model.parameters(), lr=LR),
        trainable,
        args=(frozen,),
        dataset_size=H.N,
        expected_batch_size=H.PER_DEVICE * H.ACCUM,
        noise_multiplier=SIGMA,
        delta=1.0 / H.N**2,
        clipping_norm=H.CLIP,
        accountant="rdp",
        seed=H.SEED,
    )
    q = H.PER_DEVICE * H.ACCUM / H.N
    chunks = split(PoissonSampler(H.N, q, seed=H.SEED).global_batch(0).tolist(), H.ACCUM)
    collate = DPDataCollator(pad_token_id=0, causal=True)
    seen = []
    for chunk in chunks:
        aux = training.accumulate(collate([data[i] for i in chunk]))
        seen.append(aux.loss_values.detach())
    training.finish_step()
    return H.params(model), torch.cat(seen)


def test_bf16_trains_and_its_step_is_the_compositions_bf16_step(tmp_path, monkeypatch):
    from opake.dpsgd.training import DPTraining
    from opake.transformers import DPTrainer

    seen: list[torch.Tensor] = []
    original = DPTraining.accumulate

    def accumulate(self, *batch, example_mask=None):
        aux = original(self, *batch, example_mask=example_mask)
        seen.append(aux.loss_values.detach())
        return aux

    data = H.token_data()
    args = H.dp_args(tmp_path, max_steps=1, bf16=True, noise_multiplier=SIGMA, learning_rate=LR)
    trainer = DPTrainer(model=H.tiny_causal_lm(), args=args, train_dataset=data)
    monkeypatch.setattr(DPTraining, "accumulate", accumulate)
    trainer.train()
    monkeypatch.undo()
    got = H.params(trainer.model)
    assert {v.dtype for v in got.values()} == {torch.float32}  # fp32 master weights
    assert trainer.dp_training.steps == 1

    bf16, bf16_losses = _composition_step(data, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    fp32, fp32_losses = _composition_step(data, None)
    torch.testing.assert_close(torch.cat(seen), bf16_losses, atol=0, rtol=0)
    for name, value in bf16.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)
    # bf16 really ran: the losses and the step differ from the fp32 composition's
    assert not torch.allclose(bf16_losses, fp32_losses, atol=1e-4, rtol=0)
    moved = max(float((got[n] - fp32[n]).abs().max()) for n in got)
    assert moved > 1e-4


def test_fp16_is_refused_with_what_to_use_instead(tmp_path):
    from opake.transformers import DPTrainer

    with pytest.raises(ConfigurationError, match=r"fp16.*per-example loss scale.*bf16=True"):
        DPTrainer(
            model=H.tiny_causal_lm(),
            args=H.dp_args(tmp_path, fp16=True),
            train_dataset=H.token_data(),
        )
    with pytest.raises(ConfigurationError, match=r"float16.*bf16"):
        DPTrainer(
            model=H.tiny_causal_lm().half(),
            args=H.dp_args(tmp_path),
            train_dataset=H.token_data(),
        )
