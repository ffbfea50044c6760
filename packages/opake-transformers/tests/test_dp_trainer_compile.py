"""DPTrainer with ``torch_compile=True``: the DP step compiled once (``DPTraining(compile=True)``)
equals the eager run; the Trainer does not compile the model; what does not compile is refused.

Inductor takes about 45 s (cold cache) to compile the tiny Llama's DP step on a 2-core CPU, so
the compiled run here traces with a Dynamo backend that runs the captured graph as it is (like
``backend="eager"``) and counts the graphs: tracing, ``fullgraph``, the one shape, chunking and
padding are what is checked; Inductor's code generation is not.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from opake.core.errors import ConfigurationError, OperationError

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning"),
]


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The graphs ``torch.compile`` captures, run as captured (no Inductor)."""
    torch._dynamo.reset()
    yield H.count_compiled_graphs(monkeypatch)
    torch._dynamo.reset()


def _trainer(tmp_path: Path, **options: Any) -> Any:
    from opake.transformers import DPTrainer

    return DPTrainer(
        model=H.tiny_causal_lm(),
        args=H.dp_args(tmp_path, max_steps=2, **options),
        train_dataset=H.token_data(),
        eval_dataset=H.token_data(8, seed=1),
    )


@pytest.mark.slow
def test_compiled_steps_equal_the_eager_steps_in_one_graph_and_the_model_is_not_compiled(
    tmp_path: Path, graphs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from accelerate.utils import DynamoBackend

    eager = _trainer(tmp_path / "eager")
    eager.train()
    assert not graphs
    assert not eager.dp_training.compiled

    caplog.set_level(logging.INFO)
    compiled = _trainer(tmp_path / "compiled", torch_compile=True)
    assert compiled.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    compiled.train()
    dp = compiled.dp_training
    assert dp.compiled
    assert dp.grad_fn.engine == "bookkeeping"
    assert dp._compiled.engine == "bookkeeping"
    assert "book-keeping engine, its batched forward and backward compiled" in caplog.text
    assert "for chunks of 4 rows" in caplog.text  # per_device_train_batch_size
    # the physical batches had other sizes than the chunks (some ran as two chunks) and the
    # examples 3 to 10 tokens, yet one shape was compiled: one graph of the batched forward and
    # backward, one of the linear layers' bound arithmetic
    sizes = {len(part) for t in range(2) for part in _physical(dp, t)}
    assert max(sizes) > H.PER_DEVICE
    assert len(sizes) > 1
    assert len(graphs) == 2
    for name, value in H.params(eager.model).items():
        torch.testing.assert_close(
            H.params(compiled.model)[name], value, atol=1e-5, rtol=1e-5, msg=name
        )
    assert compiled.state.log_history[-1]["epsilon"] == eager.state.log_history[-1]["epsilon"]

    # HF's own model compile is not applied: training and evaluation see the model itself
    assert not isinstance(compiled.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(compiled.model, torch._dynamo.eval_frame.OptimizedModule)
    metrics = compiled.evaluate()
    assert "eval_loss" in metrics
    assert len(graphs) == 2


def _physical(dp: Any, step: int) -> list[list[int]]:
    from opake.transformers._collate import split

    return split(dp.sampler.batch_at(step), H.ACCUM)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"privacy_unit_column": "user"}, "privacy_unit_column='user'"),
        ({"torch_compile_backend": "eager"}, "torch_compile_backend='eager'"),
        ({"torch_compile_mode": "max-autotune"}, "torch_compile_mode='max-autotune'"),
    ],
)
def test_what_does_not_compile_is_refused_at_construction(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _trainer(tmp_path, torch_compile=True, **options)


def test_default_backend_and_mode_are_accepted(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, torch_compile_backend="inductor", torch_compile_mode="default")
    assert trainer.args.torch_compile


def test_a_model_compile_configured_elsewhere_is_refused() -> None:
    from accelerate.utils import TorchDynamoPlugin

    from opake.transformers._compile import check_model_not_compiled

    state = SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    trainer = SimpleNamespace(
        args=SimpleNamespace(torch_compile=True), accelerator=SimpleNamespace(state=state)
    )
    with pytest.raises(OperationError, match="would also compile the model"):
        check_model_not_compiled(trainer)
    trainer.args.torch_compile = False
    check_model_not_compiled(trainer)  # not asked to compile: the Trainer's business


def test_the_automatic_microbatch_is_the_compiled_chunk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _trainer(tmp_path, torch_compile=True, memory_budget_gb=0.001)
    with caplog.at_level(logging.INFO, logger="opake.transformers"):
        trainer.create_optimizer()  # builds the DP step (the graph compiles on the first step)
    assert trainer.dp_training.compiled
    assert trainer.microbatch_choice.microbatch == 1  # nothing fits 1 MB: one at a time
    assert "compiles once, for chunks of 1 rows (the microbatch)" in caplog.text


def test_chunk_rows_are_the_microbatch_else_the_physical_batch() -> None:
    from opake.transformers._compile import chunk_rows

    args = SimpleNamespace(
        torch_compile=True, per_device_train_batch_size=6, gradient_accumulation_steps=2
    )
    args.world_size = 2
    assert chunk_rows(args, 4, max_batch=None) == 4  # given or chosen: one compiled shape
    assert chunk_rows(args, None, max_batch=None) == 6  # Poisson: the expected physical batch
    assert chunk_rows(args, None, max_batch=40) == 10  # fixed shapes: a physical batch's slots
    args.torch_compile = False
    assert chunk_rows(args, None, max_batch=40) is None


def test_training_batches_are_padded_to_one_length() -> None:
    from opake.transformers import DPDataCollator

    collate = DPDataCollator(pad_token_id=0, causal=True, pad_to=6)
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0], [8, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, -100, -100], [8, *[-100] * 5]]
    assert "attention_mask" not in batch  # still right-padded: no mask needed

    classes = DPDataCollator(pad_token_id=0, causal=False, pad_to=4)
    batch = classes([{"input_ids": [5, 6], "labels": 1}, {"input_ids": [7], "labels": 0}])
    assert batch["input_ids"].shape == (2, 4)
    assert batch["labels"].tolist() == [1, 0]
    assert batch["attention_mask"][:, 0, 0, :].eq(0).tolist() == [
        [True, True, False, False],
        [True, False, False, False],
    ]
    longer = collate([{"input_ids": list(range(1, 9))}])
    assert longer["input_ids"].shape == (1, 8)  # already longer: kept

    def four_d(rows: list[Any]) -> dict[str, Any]:
        return {
            "input_ids": torch.ones(len(rows), 2, dtype=torch.long),
            "attention_mask": torch.zeros(len(rows), 1, 2, 2),
        }

    with pytest.raises(ConfigurationError, match="cannot be padded to 6 tokens"):
        DPDataCollator(causal=True, base=four_d, pad_to=6)([{}])


def test_examples_without_input_ids_keep_their_lengths_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from opake.transformers._compile import sequence_length

    args = SimpleNamespace(torch_compile=True)
    assert sequence_length(args, H.token_data()) == 10
    with caplog.at_level(logging.WARNING, logger="opake.transformers"):
        assert sequence_length(args, [{"text": "a b"}]) is None
    assert "each new length compiles the DP step again" in caplog.text
    assert sequence_length(SimpleNamespace(torch_compile=False), H.token_data()) is None
