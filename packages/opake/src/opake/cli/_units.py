"""Privacy units for ``opake train --privacy-unit FIELD``: blocks that never mix units.

Without a unit, each training block of ``--block-size`` tokens is one example: the documents
are concatenated and cut into blocks, so a block may hold the end of one record and the start of
the next. With ``--privacy-unit FIELD`` every record of a JSONL file names its unit (a user, a
patient, an author) and the unit — all its records together — is what ε protects. The blocks
are then cut **per unit**: a unit's records (each followed by the end-of-document token) are
concatenated and cut into blocks, so no block holds text of two units; each unit's incomplete
tail is dropped, and a unit with less than one block of text has no block (counted in the plan).
Validation holds out whole units.

>>> from opake.cli._data import Corpus
>>> corpus = Corpus("demo", ("abcd", "e", "ghij"), ("s:ann", "s:bob", "s:ann"))
>>> blocks = unit_blocks(corpus, list, block_size=3, eos_token_id=0)
>>> blocks.rows, blocks.units, blocks.dropped
([['a', 'b', 'c'], ['d', 0, 'g'], ['h', 'i', 'j']], ['s:ann', 's:ann', 's:ann'], 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.cli._data import Corpus

__all__ = ["UnitBlocks", "split_units", "unit_blocks"]

T = TypeVar("T")


@dataclass(frozen=True)
class UnitBlocks(Generic[T]):
    """Blocks cut per unit: the rows, each row's unit, and how many units had no full block."""

    rows: list[list[T]]
    units: list[str]
    dropped: int


def unit_blocks(
    corpus: Corpus,
    encode: Callable[[str], Sequence[T]],
    *,
    block_size: int,
    eos_token_id: T | None,
) -> UnitBlocks[T]:
    """Cut each unit's concatenated records into full blocks (units in order of first record)."""
    if corpus.units is None:
        raise ConfigurationError("unit_blocks needs a corpus read with a unit field")
    if block_size < 2:
        raise ConfigurationError(f"block_size={block_size}: expected at least 2 tokens")
    streams: dict[str, list[Any]] = {}
    for doc, unit in zip(corpus.documents, corpus.units, strict=True):
        stream = streams.setdefault(unit, [])
        stream.extend(encode(doc))
        if eos_token_id is not None:
            stream.append(eos_token_id)
    rows: list[list[T]] = []
    units: list[str] = []
    dropped = 0
    for unit, stream in streams.items():
        n = len(stream) // block_size
        dropped += n == 0
        rows.extend(stream[i * block_size : (i + 1) * block_size] for i in range(n))
        units.extend([unit] * n)
    return UnitBlocks(rows, units, dropped)


def split_units(
    blocks: torch.Tensor, units: Sequence[str], *, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Hold out a ``val_fraction`` of the **units** (shuffled with *seed*) with all their blocks.

    Returns ``(train, val, train_units)``: the training blocks keep the order of *blocks*.

    >>> import torch
    >>> train, val, kept = split_units(torch.arange(10).view(5, 2), ["a", "a", "b", "c", "c"],
    ...                                val_fraction=0.34, seed=0)
    >>> tuple(train.shape), tuple(val.shape), sorted(set(kept))
    ((3, 2), (2, 2), ['a', 'b'])
    """
    import torch

    if not 0.0 < val_fraction < 1.0:
        raise ConfigurationError(
            f"val_fraction={val_fraction}: expected a fraction strictly between 0 and 1"
        )
    names = list(dict.fromkeys(units))
    if len(names) < 2:
        raise ConfigurationError(
            f"--privacy-unit: the data has {len(names)} unit(s) with a full block; need at least "
            "2 (one to train, one to validate): give more units or a smaller --block-size"
        )
    n_val = max(1, math.floor(len(names) * val_fraction))
    perm = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()
    held = {names[i] for i in perm[:n_val]}
    train_rows = [i for i, u in enumerate(units) if u not in held]
    val_rows = [i for i, u in enumerate(units) if u in held]
    index = torch.tensor
    return (
        blocks[index(train_rows, dtype=torch.long)],
        blocks[index(val_rows, dtype=torch.long)],
        [units[i] for i in train_rows],
    )
