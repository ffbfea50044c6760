"""A self-contained byte-level tokenizer: 256 byte tokens plus an end-of-document token.

It needs no vocabulary file and no download, so ``opake train`` runs anywhere. It is saved next to
the trained model twice: as ``opake_tokenizer.json`` (read by ``opake train --model``) and as a
Hugging Face fast tokenizer with the same ids (``tokenizer.json``, built with the ``tokenizers``
library by :meth:`ByteTokenizer.to_transformers`), so ``AutoTokenizer.from_pretrained`` and
``pipeline("text-generation", model=...)`` load the directory as they load any other.

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["EOS_TOKEN", "TOKENIZER_FILE", "ByteTokenizer"]

#: the file a :class:`ByteTokenizer` is saved to inside a model directory
TOKENIZER_FILE = "opake_tokenizer.json"
#: the end-of-document token's text in the Hugging Face form
EOS_TOKEN = "<|endoftext|>"


def _byte_characters() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary (the
    GPT-2 mapping the ``tokenizers`` ByteLevel pre-tokenizer and decoder use), indexed by byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: list[str] = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


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

    def to_transformers(self) -> PreTrainedTokenizerFast:
        """The same tokenizer as a Hugging Face ``PreTrainedTokenizerFast`` (ids ``0..255`` the
        bytes, ``256`` = ``<|endoftext|>``, its EOS token): a byte-level BPE without merges.

        >>> hf = ByteTokenizer().to_transformers()
        >>> hf("héllo")["input_ids"], len(hf), hf.eos_token_id
        ([104, 195, 169, 108, 108, 111], 257, 256)
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {char: b for b, char in enumerate(_byte_characters())}
        vocab[EOS_TOKEN] = self.eos_token_id
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        # transformers leaves the constructor unannotated (*args, **kwargs): its result, stated
        fast: Callable[..., PreTrainedTokenizerFast] = PreTrainedTokenizerFast
        return fast(
            tokenizer_object=backend,
            eos_token=EOS_TOKEN,
            model_max_length=10**9,
            clean_up_tokenization_spaces=False,
        )

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``opake_tokenizer.json`` and the Hugging Face form (``tokenizer.json``,
        ``tokenizer_config.json``, ...) into *directory* (created if needed); returns the path of
        ``opake_tokenizer.json``."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / TOKENIZER_FILE
        spec = {"kind": self.kind, "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        out.write_text(json.dumps(spec) + "\n", encoding="utf-8")
        self.to_transformers().save_pretrained(str(path))
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
