"""Stock Hugging Face models as users pass them: dropout on, a pad id, a tokenizer as
``processing_class``; training and ``evaluate()``."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tokenizer() -> Any:
    """A word-level tokenizer over ``w2 .. w63`` with ``<pad>`` = 0 (also its eos, as GPT-2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, H.VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<pad>"
    )


def _gpt2(dropout: float = 0.1, pad: int | None = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=H.VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=pad,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()


def _bert(dropout: float = 0.1) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=H.VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=3,
        pad_token_id=0,
    )
    return BertForSequenceClassification(config).train()


def _texts(n: int = H.N, *, labels: bool = False) -> list[dict[str, Any]]:
    """Tokenized rows as a user's ``map(tok)`` gives them (input_ids and attention_mask)."""
    tok = _tokenizer()
    rows = []
    for row in H.token_data(n, labels=labels):
        encoded = dict(tok(" ".join(f"w{max(i, 2)}" for i in row["input_ids"])))
        if labels:
            encoded["labels"] = row["labels"]
        rows.append(encoded)
    return rows


def _dp_trainer(tmp_path: Path, model: Any, data: Any, **options: Any) -> Any:
    from opake.transformers import DPTrainer

    settings = {"max_steps": 1, "reproducible": False}
    settings.update(options)
    return DPTrainer(
        model=model,
        args=H.dp_args(tmp_path, **settings),
        train_dataset=data,
        processing_class=_tokenizer(),
    )


def _trained_and_changed(trainer: Any) -> set[str]:
    before = H.params(trainer.model)
    trainer.train()
    after = H.params(trainer.model)
    assert math.isfinite(trainer.state.log_history[-1]["epsilon"])
    return {n for n in before if not torch.equal(before[n], after[n])}


# -- item: HF's data-dependent checks inside the per-example forward ---------------------------


def test_stock_gpt2_with_dropout_and_a_pad_id_trains(tmp_path):
    """transformers' padding check (``pad_token_id in input_ids``) branches on the data, which
    ``vmap`` refuses; dropout selects the vmap engine, so this crashed on the first step."""
    model = _gpt2()
    assert model.config.pad_token_id == 0
    trainer = _dp_trainer(tmp_path, model, _texts())
    assert _trained_and_changed(trainer)


@pytest.mark.filterwarnings("ignore:.*torch.jit.*is deprecated:DeprecationWarning")
def test_stock_gpt2_with_dropout_and_a_pad_id_compiles_in_one_graph(tmp_path, monkeypatch):
    """With ``torch_compile=True`` the padding check is skipped while Dynamo traces: asking
    whether a transform is active (an int) would break the compiled DP step's graph."""
    torch._dynamo.reset()
    graphs = H.count_compiled_graphs(monkeypatch)
    trainer = _dp_trainer(tmp_path, _gpt2(), _texts(), torch_compile=True)
    assert _trained_and_changed(trainer)
    torch._dynamo.reset()
    assert trainer.dp_training.compiled
    assert len(graphs) == 1


def test_stock_gpt2_with_lora_trains(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.1)
    )
    trainer = _dp_trainer(tmp_path, model, _texts())
    changed = _trained_and_changed(trainer)
    assert changed
    assert all("lora_" in n for n in changed)


def test_stock_bert_classifier_with_dropout_and_a_pad_id_trains(tmp_path):
    trainer = _dp_trainer(tmp_path, _bert(), _texts(labels=True))
    assert _trained_and_changed(trainer)


def test_the_padding_check_still_warns_outside_the_dp_step(tmp_path, monkeypatch):
    """Only the per-example forward skips the check: the model's own forward keeps it."""
    import transformers.modeling_utils as mu

    warned: list[str] = []
    monkeypatch.setattr(mu.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    model = _gpt2()
    _dp_trainer(tmp_path, model, _texts())  # DPTrainer makes the check transform-safe
    padded = torch.tensor([[5, 6, 0]])
    torch.func.vmap(lambda ids: model(input_ids=ids[None]).logits, randomness="same")(padded)
    assert warned == []  # skipped under vmap (where it used to raise)
    model(input_ids=padded)
    assert len(warned) == 1
    assert "attention_mask" in warned[0]


# -- item: evaluate() reports eval_loss for causal LMs -----------------------------------------


def _stock_eval_loss(tmp_path: Path, model: Any, data: Any, collator: Any) -> float:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        str(tmp_path / "stock"), per_device_eval_batch_size=4, report_to="none", use_cpu=True
    )
    kwargs = {"data_collator": collator} if collator is not None else {}
    trainer = Trainer(
        model=model, args=args, eval_dataset=data, processing_class=_tokenizer(), **kwargs
    )
    return float(trainer.evaluate()["eval_loss"])


@pytest.mark.parametrize("collator", [None, "language_modeling"])
def test_evaluate_returns_eval_loss_for_a_causal_lm(tmp_path, collator):
    from transformers import DataCollatorForLanguageModeling

    from opake.transformers import DPTrainer

    data = _texts(12)
    base = DataCollatorForLanguageModeling(_tokenizer(), mlm=False) if collator else None
    model = _gpt2(dropout=0.0)
    kwargs = {"data_collator": base} if base is not None else {}
    trainer = DPTrainer(
        model=model,
        args=H.dp_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=_texts(),
        eval_dataset=data,
        processing_class=_tokenizer(),
        **kwargs,
    )
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    assert math.isfinite(metrics["eval_loss"])
    # the stock Trainer's number with labels from input_ids (padding never a target)
    stock = _stock_eval_loss(
        tmp_path, model, data, DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    )
    assert metrics["eval_loss"] == pytest.approx(stock, rel=1e-5)


def test_evaluate_of_a_classifier_is_unchanged(tmp_path):
    data = _texts(12, labels=True)
    trainer = _dp_trainer(tmp_path, _bert(dropout=0.0), data, per_device_eval_batch_size=4)
    metrics = trainer.evaluate(eval_dataset=data)
    stock = _stock_eval_loss(tmp_path, trainer.model, data, None)
    assert metrics["eval_loss"] == pytest.approx(stock, rel=1e-5)


@pytest.mark.slow
def test_every_model_family_runs_its_per_example_forward_with_a_pad_id():
    """Each supported family (opake-models' tiny models, pad id set, dropout on, padding at the
    end, no attention mask as DPTrainer's collator gives it) under ``vmap(grad)``."""
    testing = pytest.importorskip("opake.models.testing")
    from opake.models import family_names
    from opake.transformers._hf_checks import make_checks_transform_safe

    failed = {}
    for family in family_names():
        model = testing.tiny_model(family).train()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = 0
        make_checks_transform_safe(model)
        params = {k: v.detach() for k, v in model.named_parameters()}
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
        ids[:, -1] = model.config.pad_token_id
        extra = {"use_cache": False} if hasattr(model.config, "use_cache") else {}

        def loss(p, x, model=model, extra=extra):
            out = torch.func.functional_call(model, p, (), {"input_ids": x[None], **extra})
            return out.logits.float().logsumexp(-1).mean()

        try:
            torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0), randomness="different")(
                params, ids
            )
        except RuntimeError as err:
            failed[family] = str(err)[:120]
    assert failed == {}


@pytest.mark.filterwarnings("default::UserWarning")
def test_lora_a_without_gradient_on_the_first_step_is_reported_as_expected(tmp_path):
    """PEFT starts each B at zero, so each A gets no gradient on step 1: the report says that
    this is expected and costs no privacy (as ``opake train`` does), not to freeze them."""
    import warnings

    peft = pytest.importorskip("peft")
    from opake.core.errors import OpakePrivacyWarning

    model = peft.get_peft_model(
        H.tiny_causal_lm(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    trainer = _dp_trainer(tmp_path, model, H.token_data())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    reports = [str(w.message) for w in caught if issubclass(w.category, OpakePrivacyWarning)]
    assert len(reports) == 1
    assert "2 LoRA A matrices get no gradient on the first step" in reports[0]
    assert "costs no privacy" in reports[0]
    assert "Freeze" not in reports[0]


def test_evaluation_keeps_the_attention_mask_and_warns_nothing(tmp_path, monkeypatch):
    """Evaluation is a plain forward: the 2-D mask is kept (no padding warning to act on)."""
    import transformers.modeling_utils as mu

    from opake.transformers import DPTrainer

    warned: list[str] = []
    monkeypatch.setattr(mu.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    trainer = DPTrainer(
        model=_gpt2(dropout=0.0),
        args=H.dp_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=_texts(),
        eval_dataset=_texts(8),
        processing_class=_tokenizer(),
    )
    batch = trainer.data_collator(_texts(3))
    assert batch["attention_mask"].dim() == 2
    assert (batch["labels"] == -100).equal(batch["attention_mask"] == 0)
    assert "eval_loss" in trainer.evaluate()
    assert not [m for m in warned if "attention_mask" in m]
