"""A self-contained byte-level tokenizer: 256 byte tokens plus an end-of-document token.

It needs no vocabulary file and no download, so ``opake train`` runs anywhere; it is saved next to
the trained model (``opake_tokenizer.json``) so the model can be used again.

>>> tok = ByteTokenizer()
>>> ids = tok.encode("héllo")
>>> ids
[104, 195, 169, 108, 108, 111]
>>> tok.decode(ids + [tok.eos_token_id])
'héllo'
>>> tok.vocab_size
257
"""

from __future__ import annotations

import json
from pathlib import Path

from opake.core.errors import ConfigurationError

__all__ = ["TOKENIZER_FILE", "ByteTokenizer"]

#: the file a :class:`ByteTokenizer` is saved to inside a model directory
TOKENIZER_FILE = "opake_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as token ids ``0..255``; id ``256`` ends a document.

    Decoding skips the end-of-document id and replaces invalid UTF-8 (a model may emit any byte
    sequence) with U+FFFD.
    """

    kind = "byte"
    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of *text* as token ids (no end-of-document token added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text from token ids; the end-of-document id is dropped."""
        bad = [i for i in ids if not 0 <= i <= self.eos_token_id]
        if bad:
            raise ConfigurationError(
                f"token id {bad[0]} is outside the byte tokenizer's range 0..{self.eos_token_id}; "
                "decode ids produced by this tokenizer"
            )
        return bytes(i for i in ids if i != self.eos_token_id).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``opake_tokenizer.json`` into *directory* (created if needed); returns its path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / TOKENIZER_FILE
        spec = {"kind": self.kind, "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        out.write_text(json.dumps(spec) + "\n", encoding="utf-8")
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ByteTokenizer:
        """Load the tokenizer saved by :meth:`save_pretrained` in *directory*."""
        path = Path(directory) / TOKENIZER_FILE
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigurationError(
                f"{path} does not exist: expected a directory written by save_pretrained"
            ) from None
        except json.JSONDecodeError as err:
            raise ConfigurationError(f"{path} is not valid JSON ({err}); re-save it") from None
        if spec.get("kind") != cls.kind or spec.get("vocab_size") != cls.vocab_size:
            raise ConfigurationError(
                f"{path} describes tokenizer {spec!r}; expected a byte tokenizer with vocab_size "
                f"{cls.vocab_size}"
            )
        return cls()

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
