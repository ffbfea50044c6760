"""Red-team round 9: one row per record, and a sequence classifier pooling its own record.

Each test failed on the earlier code: a classifier without ``config.pad_token_id`` (or with one
the collator does not pad with) pooled a padding position, which the batch's longest record
sets (2.5–2.8·C measured); a user collator packing records into shared rows was accepted
(5.4·C).
"""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError

transformers = pytest.importorskip("transformers")

from opake.transformers import DPDataCollator, DPTrainer, DPTrainingArguments  # noqa: E402

C = 1e-3


def _args(tmp_path, **options) -> DPTrainingArguments:
    return DPTrainingArguments(
        output_dir=str(tmp_path),
        noise_multiplier=1.0,
        per_sample_max_grad_norm=C,
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        microbatch_size=16,
        **options,
    )


def _config(**extra):
    """A tiny Llama configuration (one layer, vocabulary 64)."""
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )


def _classifier(pad: int | None):
    config = _config(
        max_position_embeddings=128, num_labels=2, pad_token_id=pad, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return transformers.LlamaForSequenceClassification(config)


def _records(long: int) -> tuple[list[dict], dict]:
    gen = torch.Generator().manual_seed(1)
    base = [
        {"input_ids": torch.randint(1, 63, (4,), generator=gen).tolist(), "labels": i % 2}
        for i in range(8)
    ]
    return base, {"input_ids": torch.randint(1, 63, (long,), generator=gen).tolist(), "labels": 0}


def _contribution(trainer: DPTrainer, base: list[dict], target: dict) -> float:
    """‖S(D ∪ {x}) − S(D)‖ of one physical batch's clipped sum, before noise."""
    trainer.create_optimizer()
    dp = trainer.dp_training
    collate = trainer.get_train_dataloader().collate_fn

    def clipped_sum(items: list[dict]) -> dict[str, torch.Tensor]:
        batch = collate(list(enumerate(items)))
        batch.pop("opake_batch_indices")
        batch.pop("opake_example_mask", None)
        dp.accumulate(batch)
        sums = {k: v.clone() for k, v in dp.optimizer._sums.items()}
        dp.zero_grad()
        return sums

    with_x, without = clipped_sum([*base, target]), clipped_sum(base)
    return float(torch.sqrt(sum(((with_x[k] - without[k]) ** 2).sum() for k in with_x)))


@pytest.mark.parametrize(("pad", "match"), [(None, "pad_token_id is None"), (63, "pads with 0")])
def test_a_classifier_that_would_pool_padding_is_refused(tmp_path, pad, match) -> None:
    base, target = _records(100)
    with pytest.raises(ConfigurationError, match=match):
        DPTrainer(model=_classifier(pad), args=_args(tmp_path), train_dataset=[*base, target])


@pytest.mark.parametrize("engine", ["vmap", "auto"])
def test_a_long_record_moves_a_classifier_s_sum_by_at_most_c(tmp_path, engine) -> None:
    base, target = _records(100)
    trainer = DPTrainer(
        model=_classifier(0), args=_args(tmp_path, engine=engine), train_dataset=[*base, target]
    )
    assert _contribution(trainer, base, target) <= C * (1 + 1e-5)


def test_a_collator_packing_records_into_rows_is_refused(tmp_path) -> None:
    def packing(features):
        tokens = [t for f in features for t in f["input_ids"]]
        rows = [tokens[i : i + 8] for i in range(0, len(tokens), 8)]
        rows[-1] = rows[-1] + [0] * (8 - len(rows[-1]))
        ids = torch.tensor(rows)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    model = transformers.LlamaForCausalLM(_config())
    records = [{"input_ids": [5, 6, 7, 8]} for _ in range(4)]  # 16 tokens: two packed rows
    trainer = DPTrainer(
        model=model, args=_args(tmp_path), train_dataset=records, data_collator=packing
    )
    collate = trainer.get_train_dataloader().collate_fn
    with pytest.raises(ConfigurationError, match="rows for 4 records"):
        collate(list(enumerate(records)))

    # as many rows as records, but each holding another record's tokens
    def swapped(features):
        ids = torch.tensor([[9, 10, 0, 0], [5, 6, 7, 8]])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    records = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]
    with pytest.raises(ConfigurationError, match="not its record"):
        DPDataCollator(causal=True, base=swapped)(records)


def test_rows_the_check_cannot_read_are_refused() -> None:
    """Red-team round 10: a batch whose rows could not be checked passed unchecked: input_ids
    not [records, tokens] (one flat row of every record's tokens), or a 4-D attention mask
    (which can join two records' tokens in one row)."""
    records = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]

    def flat(features):
        return {"input_ids": torch.tensor([t for f in features for t in f["input_ids"]])}

    with pytest.raises(ConfigurationError, match=r"input_ids of shape \(6,\)"):
        DPDataCollator(causal=True, base=flat)(records)

    def four_d(features):  # a tokenizing collator: the records hold text, not input_ids
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 5, 6]])  # row 1: record 1, then record 0's
        return {"input_ids": ids, "attention_mask": torch.ones(2, 1, 4, 4)}

    texts = [{"text": "five six seven eight"}, {"text": "nine ten"}]
    with pytest.raises(ConfigurationError, match="attention_mask of shape"):
        DPDataCollator(causal=True, base=four_d)(texts)
    # with the records' input_ids too: collated alone, record 1 is not row 1
    with pytest.raises(ConfigurationError):
        DPDataCollator(causal=True, base=four_d)(records)


def test_a_tokenizing_collator_mixing_records_into_rows_is_refused() -> None:
    """Red-team round 11: text records (no input_ids) and a collator that streams the batch's
    tokens into as many rows as records passed every check (3.26·C measured for one record).
    Each row must be what the collator makes of its record alone: tokens and labels."""
    vocab = {
        w: i + 1
        for i, w in enumerate(
            ["the", "a", "cat", "dog", "sat", "ran", "far", "away", "home", "now"]
        )
    }

    def tokens(text):
        return [vocab[w] for w in text.split()]

    def streaming(features):
        ids = [t for f in features for t in tokens(f["text"])]
        width = len(ids) // len(features)
        rows = torch.tensor(ids[: width * len(features)]).reshape(len(features), width)
        return {"input_ids": rows, "attention_mask": torch.ones_like(rows)}

    def padding(features, shift_labels=False):
        rows = [tokens(f["text"]) for f in features]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = (ids != 0).long()
        labels = ids.roll(1, dims=0) if shift_labels else ids.clone()  # another row's targets
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    texts = [{"text": "the cat sat"}, {"text": "a dog ran far away"}, {"text": "home now"}]
    with pytest.raises(ConfigurationError, match="row 1 is not what it makes of record 1 alone"):
        DPDataCollator(causal=True, base=streaming)(texts)
    with pytest.raises(ConfigurationError, match=r"its labels differ"):
        DPDataCollator(causal=True, base=lambda f: padding(f, shift_labels=True))(texts)
    batch = DPDataCollator(causal=True, base=padding)(texts)  # one record per row: accepted
    assert batch["labels"].tolist()[2] == [9, 10, -100, -100, -100]


def test_padding_of_another_id_is_refused_for_a_classifier() -> None:
    def pads_with_one(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [1] * (width - len(f["input_ids"])) for f in features])
        mask = torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        )
        return {"input_ids": ids, "attention_mask": mask}

    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    with pytest.raises(ConfigurationError, match="padded with an id"):
        DPDataCollator(pad_token_id=0, causal=False, base=pads_with_one)(features)
    assert DPDataCollator(pad_token_id=1, causal=False, base=pads_with_one)(features)


def test_records_with_other_fields_than_the_first_are_refused() -> None:
    """Red-team round 12: the built-in collator took the batch's fields from its first record:
    a record without ``labels`` at row 0 dropped every row's labels (their prompt masks), so
    the other rows trained on their prompts (3.58·C measured)."""
    masked = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
    with pytest.raises(ConfigurationError, match="record 1 of the batch has the fields"):
        DPDataCollator(causal=True)([{"input_ids": [9, 10]}, masked])
    with pytest.raises(ConfigurationError, match="same fields"):
        DPDataCollator(causal=True)([masked, {"input_ids": [9, 10], "extra": [1, 2]}])
    batch = DPDataCollator(causal=True)([masked, {"input_ids": [9, 10], "labels": [9, 10]}])
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [9, 10, -100, -100]]


def test_a_collator_s_other_inputs_must_be_the_record_s_alone() -> None:
    """Red-team round 12: only input_ids and labels were compared with the record alone;
    end-aligned ``position_ids`` (set by the batch's longest record) moved a GPT-2's sum by
    3.49·C. Every tensor the model gets is compared now."""

    def with_positions(features, end_aligned):
        rows = [f["input_ids"] for f in features]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        if end_aligned:  # positions counted back from the batch's longest record
            positions = torch.stack(
                [torch.arange(width - len(r), 2 * width - len(r)) for r in rows]
            )
        else:
            positions = torch.arange(width).expand(len(rows), width).clone()
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}

    records = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]
    with pytest.raises(ConfigurationError, match="its position_ids differ"):
        DPDataCollator(causal=True, base=lambda f: with_positions(f, True))(records)
    batch = DPDataCollator(causal=True, base=lambda f: with_positions(f, False))(records)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_rows_cut_to_another_record_s_length_or_numpy_labels_are_refused() -> None:
    """Red-team round 13: a row was accepted when its kept tokens were a prefix of its record's
    alone, so a collator cutting every row to the batch's shortest record passed (3.51·C with
    8 other records, 6.90·C with 32); labels returned as numpy arrays were never compared."""

    def shortest(features):
        width = min(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"][:width] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def numpy_labels(features):
        rows = [f["input_ids"] for f in features]
        width, short = max(map(len, rows)), min(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = (ids != 0).long()
        labels = ids.numpy().copy()
        labels[:, short:] = -100  # every row's targets cut at the batch's shortest record
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    records = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]
    with pytest.raises(ConfigurationError, match="its input_ids differ"):
        DPDataCollator(causal=True, base=shortest)(records)
    with pytest.raises(ConfigurationError, match="its labels differ"):
        DPDataCollator(causal=True, base=numpy_labels)(records)
    alone = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11, 12]}]
    assert DPDataCollator(causal=True, base=shortest)(alone)["input_ids"].shape == (2, 4)
