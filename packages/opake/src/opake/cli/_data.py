"""Corpora for ``opake train``: loading, block construction, train/validation split, baseline.

The default corpus ships with Python itself: the standard library's documentation in
``pydoc_data.topics`` (about 465k characters of English). ``stdlib`` selects the standard
library's own ``.py`` source instead. Any other value is a path to a UTF-8 text file or to a JSONL
file with one JSON object per line holding a text field.

Each training example (the unit of privacy) is one block of ``block_size`` consecutive tokens of
the concatenated documents, each document followed by the end-of-document token.

>>> corpus = Corpus("demo", ("abc", "de"))
>>> blocks = make_blocks(corpus, list, block_size=3, eos_token_id=9)
>>> blocks
[['a', 'b', 'c'], [9, 'd', 'e']]
"""

from __future__ import annotations

import json
import math
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "NAMED_CORPORA",
    "Corpus",
    "json_records",
    "load_corpus",
    "make_blocks",
    "split_blocks",
    "unigram_entropy",
]

#: corpora available without a file, by name
NAMED_CORPORA = {
    "pydoc": "Python's standard-library documentation (pydoc_data.topics, ~465k characters)",
    "stdlib": "Python's standard-library .py source (~12 MiB; tests and site-packages excluded)",
}

T = TypeVar("T")


@dataclass(frozen=True)
class Corpus:
    """Named documents of text.

    >>> Corpus("x", ("ab", "c")).num_chars
    3
    """

    name: str
    documents: tuple[str, ...]
    #: each document's privacy unit (``--privacy-unit FIELD`` of a JSONL file), else ``None``
    units: tuple[str, ...] | None = None

    @property
    def num_chars(self) -> int:
        """Total number of characters over all documents."""
        return sum(len(d) for d in self.documents)


def _pydoc() -> Corpus:
    try:
        from pydoc_data import topics
    except ImportError:  # pragma: no cover - some distributions strip pydoc_data
        raise ConfigurationError(
            "the default corpus needs the standard library's pydoc_data module, which this Python "
            "lacks; pass --data FILE (a text file or JSONL) instead"
        ) from None
    return Corpus("pydoc", tuple(topics.topics[key] for key in sorted(topics.topics)))


def _stdlib_source() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            docs.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return Corpus("stdlib", tuple(d for d in docs if d.strip()))


def json_records(path: Path) -> Iterator[tuple[int, Any]]:
    """The JSON values of a JSONL file, one a line, with their line numbers (blank lines
    skipped); the callers check that each is an object with the fields they need.

    Raises:
        ConfigurationError: a line that is not valid JSON.
    """
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigurationError(
                    f"--data {path}: line {lineno} is not valid JSON ({err.msg}); expected one "
                    "JSON object per line"
                ) from None
            yield lineno, record


def _read_jsonl(
    path: Path, text_field: str, unit_field: str | None = None
) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    docs = []
    units: list[str] = []
    for lineno, record in json_records(path):
        if not isinstance(record, dict) or text_field not in record:
            raise ConfigurationError(
                f"--data {path}: line {lineno} has no {text_field!r} field; expected objects "
                f'like {{"{text_field}": "..."}} (choose the field with --text-field)'
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise ConfigurationError(
                f"--data {path}: line {lineno}: field {text_field!r} is "
                f"{type(text).__name__}, expected a string"
            )
        docs.append(text)
        if unit_field is not None:
            units.append(_unit_key(record, unit_field, path, lineno))
    return tuple(docs), (tuple(units) if unit_field is not None else None)


def _unit_key(record: dict[str, Any], unit_field: str, path: Path, lineno: int) -> str:
    """The record's privacy unit: a string or an integer (kept apart: ``"7"`` and ``7`` are
    the same unit only if the file writes them the same way)."""
    if unit_field not in record:
        raise ConfigurationError(
            f"--data {path}: line {lineno} has no {unit_field!r} field (--privacy-unit); every "
            "record must name its unit — a record without one cannot be protected with its "
            "unit's other records"
        )
    key = record[unit_field]
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ConfigurationError(
            f"--data {path}: line {lineno}: the unit field {unit_field!r} is "
            f"{type(key).__name__}, expected a string or an integer id"
        )
    return f"{type(key).__name__}:{key}"


def load_corpus(
    spec: str | None = None, *, text_field: str = "text", unit_field: str | None = None
) -> Corpus:
    """Load the corpus named by *spec*.

    Args:
        spec: ``None`` or ``"pydoc"`` (default), ``"stdlib"``, or a path to a ``.jsonl`` file (one
            JSON object per line with a *text_field* string) or to any UTF-8 text file (one
            document).
        text_field: the JSONL field holding the text.
        unit_field: the JSONL field naming each record's privacy unit (``--privacy-unit``);
            only for a ``.jsonl`` file.

    Raises:
        ConfigurationError: the file is missing, unreadable, malformed, or holds no text.

    >>> load_corpus().name
    'pydoc'
    """
    if unit_field is not None and (spec is None or not spec.lower().endswith(".jsonl")):
        raise ConfigurationError(
            f"--privacy-unit {unit_field}: needs a JSONL file whose records carry that field "
            f"(--data FILE.jsonl); {spec or 'pydoc'} has no per-record units — leave "
            "--privacy-unit out to protect each training block"
        )
    units: tuple[str, ...] | None = None
    if spec is None or spec == "pydoc":
        corpus = _pydoc()
    elif spec == "stdlib":
        corpus = _stdlib_source()
    else:
        path = Path(spec)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigurationError(
                f"--data {spec}: the file {what}; expected a text file, a .jsonl file, or one of "
                f"{', '.join(NAMED_CORPORA)}"
            )
        try:
            if path.suffix.lower() == ".jsonl":
                docs, units = _read_jsonl(path, text_field, unit_field)
            else:
                docs = (path.read_text(encoding="utf-8"),)
        except UnicodeDecodeError as err:
            raise ConfigurationError(
                f"--data {spec}: not UTF-8 text ({err.reason} at byte {err.start}); convert it "
                "to UTF-8"
            ) from None
        except OSError as err:
            raise ConfigurationError(f"--data {spec}: cannot read it ({err.strerror})") from None
        corpus = Corpus(str(path), docs, units)
    kept = [i for i, d in enumerate(corpus.documents) if d.strip()]
    if not kept:
        raise ConfigurationError(
            f"--data {corpus.name}: the corpus is empty (no non-blank text); give a file with text"
        )
    documents = tuple(corpus.documents[i] for i in kept)
    if corpus.units is None:
        return Corpus(corpus.name, documents)
    return Corpus(corpus.name, documents, tuple(corpus.units[i] for i in kept))


def make_blocks(
    corpus: Corpus,
    encode: Callable[[str], Sequence[T]],
    *,
    block_size: int,
    eos_token_id: T | None,
) -> list[list[T]]:
    """Concatenate the encoded documents (each followed by *eos_token_id*) into full blocks.

    The incomplete tail is dropped, so every block holds exactly *block_size* tokens.
    """
    if block_size < 2:
        raise ConfigurationError(f"block_size={block_size}: expected at least 2 tokens")
    stream: list[Any] = []
    for doc in corpus.documents:
        stream.extend(encode(doc))
        if eos_token_id is not None:
            stream.append(eos_token_id)
    n = len(stream) // block_size
    return [stream[i * block_size : (i + 1) * block_size] for i in range(n)]


def split_blocks(
    blocks: torch.Tensor, *, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle *blocks* (rows) with *seed* and split off ``val_fraction`` for validation.

    Returns ``(train, val)``; both are non-empty or :class:`ConfigurationError` is raised.

    >>> import torch
    >>> train, val = split_blocks(torch.arange(20).view(10, 2), val_fraction=0.2, seed=0)
    >>> tuple(train.shape), tuple(val.shape)
    ((8, 2), (2, 2))
    """
    import torch

    if not 0.0 < val_fraction < 1.0:
        raise ConfigurationError(
            f"val_fraction={val_fraction}: expected a fraction strictly between 0 and 1"
        )
    n = int(blocks.shape[0])
    n_val = max(1, math.floor(n * val_fraction))
    if n - n_val < 1:
        raise ConfigurationError(
            f"the corpus gives only {n} block(s): too few for a train/validation split; give "
            "more text or a smaller --block-size"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return blocks[perm[n_val:]], blocks[perm[:n_val]]


def unigram_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of *tokens* under their own empirical unigram distribution.

    No model that ignores context can score lower on these tokens, so it is a strict baseline for
    a language model's validation loss; it uses the validation tokens only (nothing private from
    the training split).

    >>> import torch
    >>> round(unigram_entropy(torch.tensor([0, 1, 0, 1]), vocab_size=2), 4)
    0.6931
    """
    import torch

    counts = torch.bincount(tokens.flatten().long(), minlength=vocab_size).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())
