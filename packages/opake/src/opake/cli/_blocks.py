"""The training data of a run: the corpus tokenised, cut into blocks and split.

Without ``--privacy-unit`` a block of ``--block-size`` tokens is one example (the corpus is cut
as one stream: :func:`~opake.cli._data.make_blocks`); with it, blocks are cut per unit and whole
units are held out (:mod:`opake.cli._units`). Post-training records (SFT conversations or
prompt/completion pairs, DPO preference pairs) are one example each, whatever their length
(:mod:`opake.cli._records`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.cli._checks import check_model_fits
from opake.cli._data import Corpus, load_corpus, make_blocks, split_blocks
from opake.cli._models import load_tokenizer
from opake.cli._records import (
    DEFAULT_BETA,
    KINDS,
    PostTraining,
    cut_rows,
    detect_kind,
    read_rows,
)
from opake.cli._settings import TrainSettings
from opake.cli._tokenizer import ByteTokenizer
from opake.cli._units import split_units, unit_blocks
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["Data", "data_kind", "encoder", "load_blocks", "record_kind"]


def encoder(tokenizer: Any) -> tuple[Callable[[str], list[int]], int | None, int]:
    """The tokenizer's text → ids function (no special tokens), its end-of-document id and the
    vocabulary size."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode, tokenizer.eos_token_id, tokenizer.vocab_size

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode, tokenizer.eos_token_id, len(tokenizer)


@dataclass(frozen=True)
class Data:
    """The training data of a run.

    Attributes:
        corpus: the documents (of post-training records: the file's name alone).
        tokenizer: the model's tokenizer.
        train, val: token ids: blocks ``[N, block]``, SFT rows ``[N, L]`` or DPO pairs
            ``[N, 2, L]`` (chosen, rejected).
        vocab: the tokenizer's vocabulary size.
        units: with ``--privacy-unit``, each training block's unit.
        train_labels, val_labels: post-training records' labels (-100: not a target), shaped
            as the ids.
        post: what the post-training records are (``None``: language modelling on text).
    """

    corpus: Corpus
    tokenizer: Any
    train: torch.Tensor
    val: torch.Tensor
    vocab: int
    units: list[str] | None = None
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None
    post: PostTraining | None = None


def load_blocks(
    settings: TrainSettings, model_source: Any, model_is_dir: bool, notes: list[str]
) -> Data:
    """The corpus (or the post-training records), the tokenizer, the training and validation
    blocks, the vocabulary size and, with ``--privacy-unit``, each training block's unit."""
    import torch

    kind = record_kind(settings)
    if kind != "text":
        tokenizer = load_tokenizer(settings.model)
        encode, eos, vocab = encoder(tokenizer)
        check_model_fits(
            model_source, model_is_dir, block_size=settings.block_size, vocab_size=vocab
        )
        data = _records(settings, kind, tokenizer, encode=encode, eos=eos, vocab=vocab)
        note = duplicates_note(data.train, data.train_labels)
        if note is not None:
            notes.append(note)
        return data
    corpus = load_corpus(
        settings.data, text_field=settings.text_field, unit_field=settings.privacy_unit
    )
    tokenizer = load_tokenizer(settings.model)
    encode, eos, vocab = encoder(tokenizer)
    check_model_fits(model_source, model_is_dir, block_size=settings.block_size, vocab_size=vocab)
    if settings.privacy_unit is not None:
        train, val, units = _unit_split(settings, corpus, encode, eos, notes)
        return Data(corpus, tokenizer, train, val, vocab, units)
    rows = make_blocks(corpus, encode, block_size=settings.block_size, eos_token_id=eos)
    if len(rows) < 2:
        raise ConfigurationError(
            f"--data {corpus.name}: {corpus.num_chars} characters give {len(rows)} block(s) of "
            f"{settings.block_size} tokens; need at least 2 (one to train, one to validate): "
            "give more text or a smaller --block-size"
        )
    blocks = torch.tensor(rows, dtype=torch.long)
    train, val = split_blocks(blocks, val_fraction=settings.val_fraction, seed=settings.seed)
    if settings.max_val_blocks is not None:
        val = val[: settings.max_val_blocks]
    return Data(corpus, tokenizer, train, val, vocab)


def duplicates_note(train: torch.Tensor, labels: torch.Tensor | None) -> str | None:
    """A note when training records repeat exactly (tokens and targets): ε is per record, so
    a person whose record appears k times is protected as a group of k.

    >>> import torch
    >>> print(duplicates_note(torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2]]), None))
    2 training record(s) repeat another exactly (1 record(s) appear up to 3 times): ε protects each record, so a person whose record appears k times is protected as a group of k (about k·ε by group privacy); remove the copies if they are one person's
    >>> duplicates_note(torch.tensor([[1, 2], [3, 4]]), None) is None
    True
    """  # noqa: E501 - the doctest's expected message is one line
    import torch

    rows = train.reshape(train.shape[0], -1)
    if labels is not None:
        rows = torch.cat([rows, labels.reshape(labels.shape[0], -1)], dim=1)
    _, counts = torch.unique(rows, dim=0, return_counts=True)
    repeated = counts[counts > 1]
    if not repeated.numel():
        return None
    extra = int((repeated - 1).sum())
    return (
        f"{extra} training record(s) repeat another exactly ({repeated.numel()} record(s) appear "
        f"up to {int(repeated.max())} times): ε protects each record, so a "
        "person whose record appears k times is protected as a group of k (about k·ε by group "
        "privacy); remove the copies if they are one person's"
    )


def data_kind(settings: TrainSettings) -> str:
    """What ``--data`` holds (:data:`~opake.cli._records.KINDS`): a JSONL file's first record's
    kind, else ``"text"``."""
    spec = settings.data
    kind = "text"
    if spec is not None and spec.lower().endswith(".jsonl") and Path(spec).is_file():
        with contextlib.suppress(UnicodeDecodeError):  # the text reader says so
            kind = detect_kind(Path(spec), settings.text_field)
    return kind


def record_kind(settings: TrainSettings) -> str:
    """What ``--data`` holds (:func:`data_kind`), checked against ``--objective``: preference
    records need ``--objective dpo``, which needs them."""
    spec, kind = settings.data, data_kind(settings)
    objective = settings.objective
    if kind == "preference" and objective != "dpo":
        raise ConfigurationError(
            f"--data {spec}: preference records (prompt, chosen, rejected) train DPO, which is "
            "never chosen for you: pass --objective dpo (β with --dpo-beta, default "
            f"{DEFAULT_BETA:g})"
        )
    if objective == "dpo" and kind != "preference":
        raise ConfigurationError(
            f"--objective dpo needs records with prompt, chosen and rejected; {spec} holds "
            f"{KINDS[kind]} records"
        )
    if objective == "sft" and kind == "text":
        raise ConfigurationError(
            f"--objective sft needs messages or prompt/completion records; {spec} holds text "
            "records: leave --objective out to train a language model on them"
        )
    if kind != "text" and settings.privacy_unit is not None:
        raise ConfigurationError(
            f"--privacy-unit {settings.privacy_unit} with {KINDS[kind]} records: each record is "
            "the privacy unit of SFT and DPO; drop --privacy-unit"
        )
    return kind


def _records(
    settings: TrainSettings,
    kind: str,
    tokenizer: Any,
    *,
    encode: Callable[[str], list[int]],
    eos: int | None,
    vocab: int,
) -> Data:
    """Post-training records: one row per record (two for a preference pair), cut at
    ``--block-size`` and counted, whole records held out for validation."""
    import torch

    path = Path(str(settings.data))
    rows = read_rows(path, kind, tokenizer=tokenizer, encode=encode, eos=eos, model=settings.model)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (eos if eos is not None else 0)
    ids, labels, truncated, dropped = cut_rows(rows, max_length=settings.block_size, pad=pad)
    if ids.shape[0] < 2:
        raise ConfigurationError(
            f"--data {path}: {ids.shape[0]} of {len(rows.ids)} record(s) have a target token "
            f"within --block-size {settings.block_size}; need at least 2 (one to train, one to "
            "validate): give more records or a larger --block-size"
        )
    dpo = kind == "preference"
    if not dpo:  # one row per record
        ids, labels = ids[:, 0], labels[:, 0]
    order = torch.arange(ids.shape[0])
    train, val = split_blocks(order, val_fraction=settings.val_fraction, seed=settings.seed)
    if settings.max_val_blocks is not None:
        val = val[: settings.max_val_blocks]
    post = PostTraining(
        kind=kind,
        objective="dpo" if dpo else "sft",
        beta=(settings.dpo_beta or DEFAULT_BETA) if dpo else None,
        records=len(rows.ids),
        truncated=truncated,
        dropped=dropped,
        max_length=settings.block_size,
        chat=rows.chat,
    )
    corpus = Corpus(str(path), ())
    return Data(
        corpus, tokenizer, ids[train], ids[val], vocab, None, labels[train], labels[val], post
    )


def _unit_split(
    settings: TrainSettings,
    corpus: Corpus,
    encode: Callable[[str], list[int]],
    eos: int | None,
    notes: list[str],
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``--privacy-unit``: blocks cut per unit, whole units held out for validation."""
    import torch

    cut = unit_blocks(corpus, encode, block_size=settings.block_size, eos_token_id=eos)
    if cut.dropped:
        notes.append(
            f"{cut.dropped} unit(s) ({settings.privacy_unit}) have less text than one block of "
            f"{settings.block_size} tokens and are left out; a smaller --block-size keeps them"
        )
    blocks = torch.tensor(cut.rows, dtype=torch.long).view(-1, settings.block_size)
    train, val, units = split_units(
        blocks, cut.units, val_fraction=settings.val_fraction, seed=settings.seed
    )
    if settings.max_val_blocks is not None:
        val = val[: settings.max_val_blocks]
    return train, val, units
