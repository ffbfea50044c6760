"""The training data of a run: the corpus tokenised, cut into blocks and split.

Without ``--privacy-unit`` a block of ``--block-size`` tokens is one example (the corpus is cut
as one stream: :func:`~opake.cli._data.make_blocks`); with it, blocks are cut per unit and whole
units are held out (:mod:`opake.cli._units`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.cli._checks import check_model_fits
from opake.cli._data import Corpus, load_corpus, make_blocks, split_blocks
from opake.cli._models import load_tokenizer
from opake.cli._settings import TrainSettings
from opake.cli._tokenizer import ByteTokenizer
from opake.cli._units import split_units, unit_blocks
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["encoder", "load_blocks"]


def encoder(tokenizer: Any) -> tuple[Callable[[str], list[int]], int | None, int]:
    """The tokenizer's text → ids function (no special tokens), its end-of-document id and the
    vocabulary size."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode, tokenizer.eos_token_id, tokenizer.vocab_size

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode, tokenizer.eos_token_id, len(tokenizer)


def load_blocks(
    settings: TrainSettings, model_source: Any, model_is_dir: bool, notes: list[str]
) -> tuple[Corpus, Any, torch.Tensor, torch.Tensor, int, list[str] | None]:
    """The corpus, the tokenizer, the training and validation blocks, the vocabulary size and,
    with ``--privacy-unit``, each training block's unit."""
    import torch

    corpus = load_corpus(
        settings.data, text_field=settings.text_field, unit_field=settings.privacy_unit
    )
    tokenizer = load_tokenizer(settings.model)
    encode, eos, vocab = encoder(tokenizer)
    check_model_fits(model_source, model_is_dir, block_size=settings.block_size, vocab_size=vocab)
    if settings.privacy_unit is not None:
        train, val, units = _unit_split(settings, corpus, encode, eos, notes)
        return corpus, tokenizer, train, val, vocab, units
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
    return corpus, tokenizer, train, val, vocab, None


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
