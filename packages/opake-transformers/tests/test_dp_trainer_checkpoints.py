"""A directory DPTrainer saved resumes only with the DP state of the step its weights are at:
``save_model`` in the middle of a logical step leaves no DP state there (and warns), and a resume
refuses a DP state whose step count is not the checkpoint's ``global_step`` (ε would be
under-reported for the weights)."""

from __future__ import annotations

import importlib.util
import shutil
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

STATE = "opake_dp_state.pt"


class _Interrupt(Exception):
    """Stands in for a Ctrl-C that lands in the Trainer's loop between two physical batches."""


def _trainer(out, cls=None, **options):
    from opake.transformers import DPTrainer

    cls = cls or DPTrainer
    return cls(
        model=H.tiny_causal_lm(), args=H.dp_args(out, **options), train_dataset=H.token_data()
    )


def _interrupted_after(batches: int):
    """A DPTrainer whose loop is interrupted after ``batches`` physical batches."""
    from opake.transformers import DPTrainer

    class Interrupted(DPTrainer):
        seen = 0

        def floating_point_ops(self, inputs):  # the Trainer runs it after each training_step
            Interrupted.seen += 1
            if Interrupted.seen == batches:
                raise _Interrupt
            return super().floating_point_ops(inputs)

    return Interrupted


def test_save_model_mid_step_removes_the_dp_state_and_warns(tmp_path, caplog):
    out = tmp_path / "final"
    first = _trainer(out, max_steps=2)
    first.train()
    first.save_model()
    first.save_state()
    assert (out / STATE).is_file()
    # a later run into the same directory, interrupted inside its second step (H.ACCUM = 2)
    second = _trainer(out, cls=_interrupted_after(H.ACCUM + 1), max_steps=4)
    with pytest.raises(_Interrupt):
        second.train()
    assert second.dp_training.steps == 1
    assert second.dp_training.pending_batches == 1
    with caplog.at_level("WARNING", logger="opake.transformers"):
        second.save_model()  # the usual Ctrl-C handler
        second.save_state()
    assert (out / "model.safetensors").is_file()  # the weights are still written
    assert not (out / STATE).exists()  # the step-2 state would resume the wrong weights
    assert "middle of a logical step" in caplog.text
    assert "cannot be resumed" in caplog.text
    again = _trainer(out, max_steps=4)
    with pytest.raises(ConfigurationError, match="privacy already spent"):
        again.train(resume_from_checkpoint=str(out))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoint-2 and checkpoint-4 of one 4-step run (gradient accumulation 2)."""
    out = tmp_path_factory.mktemp("run")
    _trainer(out, max_steps=4, save_strategy="steps", save_steps=2).train()
    return out


@pytest.mark.parametrize(("weights", "state"), [(4, 2), (2, 4)])
def test_resume_refuses_a_dp_state_of_another_step(tmp_path, checkpoints, weights, state):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(checkpoints / f"checkpoint-{weights}", checkpoint)
    shutil.copy(checkpoints / f"checkpoint-{state}" / STATE, checkpoint / STATE)
    resumed = _trainer(tmp_path, max_steps=6)
    with pytest.raises(
        ConfigurationError, match=rf"{state} DP steps.*global_step {weights}.*between two steps"
    ):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    # refused before anything was restored: nothing of the other step's state is left behind
    assert resumed.dp_training.steps == 0
    assert resumed.dp_training.epsilon() == 0.0


def _resumed_until_loaded(out, **options):
    """A DPTrainer resumed from ``out`` that stops once the checkpoint is loaded."""
    from opake.transformers import DPTrainer

    class Loaded(Exception):
        pass

    class Resumed(DPTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            raise Loaded

    resumed = _trainer(out, cls=Resumed, **options)
    with pytest.raises(Loaded):
        resumed.train(resume_from_checkpoint=str(out))
    return resumed


def test_save_model_and_save_state_between_steps_resume_after_a_budget_stop(tmp_path):
    """The legitimate path agrees: gradient accumulation, a budget stop, then save_model() and
    save_state() called together between two steps (the resumed run of a budget-stopped run
    stops at once; the DP state and the global step it is loaded with agree)."""
    out = tmp_path / "final"
    first = _trainer(out, noise_multiplier=2.0, target_epsilon=1.5, max_steps=50)
    first.train()
    steps = first.dp_training.steps
    assert first.privacy_stop_message is not None
    assert first.state.global_step == steps
    first.save_model()
    first.save_state()
    resumed = _resumed_until_loaded(out, noise_multiplier=2.0, target_epsilon=1.5, max_steps=50)
    assert resumed.dp_training.steps == resumed.state.global_step == steps


@pytest.mark.parametrize("changed", [{"noise_multiplier": 0.5}, {"per_sample_max_grad_norm": 10.0}])
def test_resume_refuses_changed_noise_or_clipping(tmp_path, checkpoints, changed):
    """The checkpoint's σ and C would be used and the ones given dropped without a word."""
    resumed = _trainer(tmp_path, max_steps=6, **changed)
    (name,) = changed
    with pytest.raises(ConfigurationError, match=rf"{name}=.*the run was saved with"):
        resumed.train(resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    assert resumed.dp_training.steps == 0  # refused before anything was restored
