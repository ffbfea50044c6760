"""``opake train`` on post-training records: SFT (``messages``, ``prompt``/``completion``) and
DPO (``prompt``/``chosen``/``rejected`` with ``--objective dpo``), one record one privacy unit."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from opake import accounting
from opake.cli import main
from opake.cli._blocks import record_kind
from opake.cli._plan import PLD_OPTIONS, _check_resumed_settings, plan_run
from opake.cli._records import PostTraining, Rows, check_post, cut_rows, read_rows
from opake.cli._settings import TrainSettings
from opake.cli._tokenizer import ByteTokenizer
from opake.core.errors import ConfigurationError

#: a chat template of the byte tokenizer: <role>content</s> per turn
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A one-layer Llama with the byte tokenizer in its Hugging Face form and a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("chat-model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=257,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=256,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = ByteTokenizer().to_transformers()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def _topics(count: int) -> list[tuple[str, str]]:
    from pydoc_data import topics

    names = sorted(topics.topics)[:count]
    return [(name, " ".join(topics.topics[name].split()[:5])) for name in names]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def chat_records(tmp_path) -> Path:
    return _jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"{name}?"},
                    {"role": "assistant", "content": answer},
                ]
            }
            for name, answer in _topics(40)
        ],
    )


@pytest.fixture
def preference_records(tmp_path) -> Path:
    pairs = _topics(41)
    return _jsonl(
        tmp_path / "prefs.jsonl",
        [
            {"prompt": f"{name}? ", "chosen": answer, "rejected": pairs[i + 1][1]}
            for i, (name, answer) in enumerate(pairs[:-1])
        ],
    )


def _settings(**kw) -> TrainSettings:
    base = {"block_size": 48, "batch_size": 8, "steps": 2, "plots": False, "progress": False}
    return TrainSettings(**{**base, **kw}).check()


def test_record_kinds_are_detected_and_dpo_is_never_chosen_for_you(
    tmp_path, chat_records, preference_records
):
    completions = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "plain"}])
    assert record_kind(_settings(data=str(chat_records))) == "messages"
    assert record_kind(_settings(data=str(completions))) == "prompt-completion"
    assert record_kind(_settings(data=str(text))) == "text"
    assert record_kind(_settings(data=str(preference_records), objective="dpo")) == "preference"
    with pytest.raises(ConfigurationError, match="pass --objective dpo"):
        record_kind(_settings(data=str(preference_records)))
    with pytest.raises(ConfigurationError, match="--objective dpo needs records with prompt"):
        record_kind(_settings(data=str(chat_records), objective="dpo"))
    with pytest.raises(ConfigurationError, match="--objective sft needs messages"):
        record_kind(_settings(data=str(text), objective="sft"))
    unknown = _jsonl(tmp_path / "other.jsonl", [{"question": "?"}])
    with pytest.raises(ConfigurationError, match="line 1 is none of the records"):
        record_kind(_settings(data=str(unknown)))


def test_conversation_targets_are_the_assistant_turns_only(tmp_path, chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "sure"},
    ]
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": turns}, {"messages": turns[:2]}])
    encode = ByteTokenizer().encode
    rows = read_rows(path, "messages", tokenizer=tokenizer, encode=encode, eos=256, model="m")
    ids, labels = rows.ids[0][0], rows.labels[0][0]
    assert bytes(ids) == b"<user>hi</s><assistant>hello</s><user>more</s><assistant>sure</s>"
    targets = bytes(t if t >= 0 else ord("|") for t in labels)
    assert targets.replace(b"|", b" ").split() == [b"hello</s>", b"sure</s>"]
    mixed = _jsonl(tmp_path / "m.jsonl", [{"messages": turns}, {"prompt": "a", "completion": "b"}])
    with pytest.raises(ConfigurationError, match=r"line 2: .*one kind of record per file"):
        read_rows(mixed, "messages", tokenizer=tokenizer, encode=encode, eos=256, model="m")


def test_long_records_are_cut_on_their_own_and_counted():
    rows = Rows(
        ids=[[[1, 2, 3]], [[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5]]],
        labels=[[[-100, 2, 3]], [[-100, -100, 3, 4, 5, 6]], [[-100, -100, -100, -100, 5]]],
        lines=[1, 2, 3],
        chat=False,
    )
    ids, labels, truncated, dropped = cut_rows(rows, max_length=4, pad=0)
    assert (truncated, dropped) == (1, 1)  # record 2 cut and kept, record 3 left without target
    assert ids[:, 0].tolist() == [[1, 2, 3, 0], [1, 2, 3, 4]]
    assert labels[:, 0].tolist() == [[-100, 2, 3, -100], [-100, -100, 3, 4]]


def test_repeated_records_are_noted_in_the_plan(tmp_path, chat_model):
    # red-team round 11: a record repeated m times moves the sum by up to m·C; ε is per record
    answers = _topics(30)
    records = [{"prompt": f"{name}? ", "completion": answer} for name, answer in answers]
    records += [records[0]] * 4 + [records[1]]
    data = _jsonl(tmp_path / "dups.jsonl", records)
    plan = plan_run(_settings(model=str(chat_model), data=str(data), out=tmp_path / "run"))
    notes = [n for n in plan.notes if "repeat another exactly" in n]
    assert len(notes) == 1, plan.notes
    assert "group of k" in notes[0]
    clean = _jsonl(tmp_path / "clean.jsonl", records[:30])
    plan = plan_run(_settings(model=str(chat_model), data=str(clean), out=tmp_path / "run2"))
    assert not [n for n in plan.notes if "repeat another exactly" in n]


def test_a_model_without_a_chat_template_is_refused_for_conversations(
    chat_records, tmp_path, capsys
):
    argv = ["train", "--model", "llama-tiny", "--data", str(chat_records)]
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err
    assert "prompt/completion records as plain strings" in err


def test_sft_loss_is_the_library_completion_loss_on_completion_tokens(
    chat_records, chat_model, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    from opake.cli._posttrain import PostStep
    from opake.cli._train import _print_plan
    from opake.functional import make_functional

    out = str(tmp_path / "r")
    settings = _settings(model=str(chat_model), data=str(chat_records), out=out, block_size=80)
    plan = plan_run(settings)
    assert plan.post is not None
    assert (plan.post.kind, plan.post.objective, plan.unit_name) == ("messages", "sft", "record")
    _print_plan(plan)
    shown = capsys.readouterr().err
    post, kept = plan.post, plan.dataset_size + plan.val.shape[0]
    assert "40 `messages` records through the model's chat template → " in shown
    assert f"→ {plan.dataset_size} training records, {plan.val.shape[0]} validation" in shown
    assert "objective sft: loss on the assistant turns only (prompt tokens get no" in shown
    assert 0 < post.truncated < kept
    assert kept + post.dropped == 40
    assert f"{post.truncated} of 40 records truncated to 80 tokens (--block-size), " in shown
    assert f"{post.dropped} dropped (no target token left)" in shown
    assert "per record with σ" in shown
    ids, labels = plan.train[:4], plan.train_labels[:4]
    for row, target in zip(ids.tolist(), labels.tolist(), strict=True):
        # the targets are the assistant's answer (cut at 80 tokens), nothing of the prompt
        text, answer = bytes(t for t in row if t < 256), bytes(t for t in target if t >= 0)
        assert answer
        assert text.endswith(b"</s><assistant>" + answer)
        assert answer.endswith(b"</s>") or len(text) == 80  # only a cut row lacks its end
    model = AutoModelForCausalLM.from_pretrained(str(chat_model))
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    post = PostStep(
        plan,
        fmodel,
        model,
        (trainable, frozen),
        forward_kwargs={"use_cache": False},
        autocast=contextlib.nullcontext,
        device=torch.device("cpu"),
    )
    losses = post.loss(trainable, frozen, {"input_ids": ids, "labels": labels})
    logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none"
    )
    expected = nll.sum(1) / (labels[:, 1:] != -100).sum(1)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


def test_dpo_trains_pairs_as_one_unit_and_accounts_records(
    preference_records, chat_model, tmp_path, capsys, monkeypatch
):
    from opake.dpsgd.training import DPTraining

    seen: list[tuple[int, torch.Tensor]] = []
    accumulate = DPTraining.accumulate

    def spy(self, *batch, **kwargs):
        seen.append((int(batch[0]["input_ids"].shape[0]), kwargs.get("units")))
        return accumulate(self, *batch, **kwargs)

    monkeypatch.setattr(DPTraining, "accumulate", spy)
    from opake.transformers.losses import DPOLoss

    weighed: list[int] = []
    inner = DPOLoss._weighed_here
    monkeypatch.setattr(
        DPOLoss, "_weighed_here", lambda self, *a: weighed.append(1) or inner(self, *a)
    )
    out = tmp_path / "dpo"
    argv = ["train", "--model", str(chat_model), "--data", str(preference_records)]
    argv += ["--objective", "dpo", "--dpo-beta", "0.2", "--block-size", "48", "--batch-size"]
    argv += ["8", "--steps", "2", "--microbatch", "4", "--reproducible", "--no-progress"]
    assert main([*argv, "--no-plots", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "objective dpo (β = 0.2) against the starting model" in err
    assert "clipped together as one privacy unit" in err
    assert "per record" in err
    summary = json.loads((out / "summary.json").read_text())
    records = summary["dataset_size"]
    assert records + summary["val_blocks"] == 40  # records, not rows
    assert summary["post_training"]["objective"] == "dpo"
    assert summary["initial_val_loss"] == pytest.approx(math.log(2), abs=1e-6)  # π = π_ref
    assert summary["sample_rate"] == pytest.approx(8 / records)
    assert summary["epsilon"] == pytest.approx(
        accounting.epsilon(
            sample_rate=8 / records,
            noise_multiplier=summary["noise_multiplier"],
            steps=2,
            delta=1 / records**2,
            accountant_options=PLD_OPTIONS,
        ),
        rel=1e-9,
    )
    assert seen
    assert weighed  # after the first step (book-keeping), weighed by the clipped forward
    for rows, units in seen:  # chosen rows, then rejected rows: pair i is rows i and P + i
        pairs = rows // 2
        assert units is not None
        assert units.tolist() == [*range(pairs), *range(pairs)]


def test_what_post_training_cannot_train_with_is_refused(preference_records, tmp_path):
    post = PostTraining("preference", "dpo", 0.1, 4, 0, 0, 16, chat=False)
    with pytest.raises(ConfigurationError, match="--precision bf16"):
        check_post(post, precision="fp16", dropout=False)
    with pytest.raises(ConfigurationError, match="pass --no-dropout"):
        check_post(post, precision="fp32", dropout=True)
    data = str(preference_records)
    with pytest.raises(ConfigurationError, match=r"--dpo-beta 0\.3 without --objective dpo"):
        _settings(data=data, dpo_beta=0.3)
    with pytest.raises(ConfigurationError, match="needs a JSONL file of records"):
        _settings(data="notes.txt", objective="sft")
    with pytest.raises(ConfigurationError, match="drop --privacy-unit"):
        _settings(data=data, objective="dpo", privacy_unit="user")
    with pytest.raises(ConfigurationError, match="--compile with --objective dpo"):
        _settings(data=data, objective="dpo", compile=True)


def test_an_audit_refuses_post_training_records(tmp_path, capsys):
    records = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "q", "completion": "a"}] * 4)
    argv = ["audit", "--model", "llama-tiny", "--data", str(records), "--no-plots"]
    assert main([*argv, "--out", str(tmp_path / "audit")]) == 2
    assert "SFT and DPO records are not audited yet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit", "--objective", "sft"])
    assert "SFT and DPO records are not audited yet" in capsys.readouterr().err


def test_runs_saved_before_the_objective_options_resume():
    saved = TrainSettings().to_dict()
    for key in ("objective", "dpo_beta", "compile"):
        del saved[key]
    _check_resumed_settings(saved, TrainSettings())
    with pytest.raises(ConfigurationError, match=r"--objective 'auto' \(saved\) vs 'sft'"):
        _check_resumed_settings(saved, TrainSettings(objective="sft"))
