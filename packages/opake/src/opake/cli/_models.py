"""Models and tokenizers for ``opake train``: named configs built locally, or pretrained models.

A named config (:data:`NAMED_MODELS`) builds a small Llama-family model with random weights and
the byte tokenizer. Anything else is resolved by :func:`opake.cli._sources.locate_model` — a local
Hugging Face directory (or an ``opake train`` output), a GGUF file (de-quantised once), or a Hub id
(through the Hugging Face cache) — and loads with its own tokenizer.

>>> sorted(NAMED_MODELS)
['llama-small', 'llama-tiny']
>>> NAMED_MODELS["llama-tiny"]["hidden_size"]
32
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.cli._sources import locate_model
from opake.cli._tokenizer import TOKENIZER_FILE, ByteTokenizer
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["NAMED_MODELS", "LoadedModel", "load_model", "load_tokenizer", "resolve_model"]

#: Llama configurations built from scratch (byte vocabulary); ``llama-small`` is the default.
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    },
    "llama-small": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 344,
    },
}

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for training, and what it was built from.

    Attributes:
        model: the ``torch.nn.Module`` (a PEFT model when LoRA is on).
        tokenizer: a :class:`~opake.cli._tokenizer.ByteTokenizer` or a Hugging Face tokenizer.
        source: the named config or the directory.
        from_directory: the weights came from a directory (not a random initialisation).
        num_parameters: all parameters.
        num_trainable: trainable parameters (the adapters alone with LoRA).
        kind: the source's kind: ``named``, ``directory``, ``gguf`` or ``hub``.
    """

    model: torch.nn.Module
    tokenizer: Any
    source: str
    from_directory: bool
    num_parameters: int
    num_trainable: int
    kind: str = "named"


def resolve_model(spec: str) -> tuple[str, bool]:
    """Check *spec* and find its files (a GGUF file is de-quantised once, a Hub id fetched
    through the Hugging Face cache); nothing is built.

    Returns ``(source, pretrained)``: the Hugging Face directory to load and ``True``, or the
    named config and ``False``.

    >>> resolve_model("llama-tiny")
    ('llama-tiny', False)
    """
    source = locate_model(spec)
    if source.directory is None:
        return spec, False
    return str(source.directory), True


def load_tokenizer(spec: str) -> ByteTokenizer | PreTrainedTokenizerBase:
    """The tokenizer for *spec*: the byte tokenizer for a named config, else the model's own
    (``opake_tokenizer.json`` of an Opake byte-level model, or the Hugging Face tokenizer)."""
    source = locate_model(spec)
    if source.directory is None:
        return ByteTokenizer()
    path = source.directory
    if (path / TOKENIZER_FILE).is_file():
        return ByteTokenizer.from_pretrained(path)
    if any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    raise ConfigurationError(
        f"--model {spec}: the model has no tokenizer (no {TOKENIZER_FILE} nor tokenizer.json / "
        "tokenizer_config.json); save its tokenizer next to it with save_pretrained"
    )


def load_model(
    spec: str,
    *,
    tokenizer: Any | None,
    block_size: int,
    lora_r: int | None = None,
    lora_alpha: float | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Build or load the causal LM named by *spec*, optionally wrapped with LoRA adapters.

    The model is put in training mode with dropout disabled in the config for named models
    (per-example ``vmap`` needs no randomness then). With *lora_r* only the adapters are
    trainable. *tokenizer* ``None``: token ids are not text (``opake tune``'s random tokens), so
    the vocabulary is not checked against a tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    located = locate_model(spec)
    is_dir = located.directory is not None
    source = str(located.directory) if located.kind == "directory" else spec
    vocab = _vocab_size(tokenizer if tokenizer is not None else ByteTokenizer())
    model: Any
    if located.directory is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(located.directory),
            local_files_only=True,
            attn_implementation="eager",
            dtype=torch.float32,
        )
        if tokenizer is not None and model.config.vocab_size < vocab:
            raise ConfigurationError(
                f"--model {spec}: its vocabulary has {model.config.vocab_size} entries but the "
                f"tokenizer produces ids up to {vocab - 1}; use the model's own tokenizer"
            )
    else:
        config = LlamaConfig(
            vocab_size=vocab,
            max_position_embeddings=max(block_size, 16),
            tie_word_embeddings=True,
            attention_dropout=0.0,
            use_cache=False,
            # the byte tokenizer's end-of-document id (generation stops there), no BOS
            bos_token_id=None,
            eos_token_id=ByteTokenizer.eos_token_id,
            **NAMED_MODELS[source],
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # _from_config (unannotated in transformers: its result, stated) also applies
            # attn_implementation
            from_config: Callable[..., LlamaForCausalLM] = LlamaForCausalLM._from_config
            model = from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    if lora_r is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=lora_r,
            # peft annotates lora_alpha as int, but scales by alpha / r: a float is fine
            lora_alpha=lora_alpha if lora_alpha is not None else 2 * lora_r,  # type: ignore[arg-type]
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            model = get_peft_model(model, lora)
    model.train()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoadedModel(model, tokenizer, source, is_dir, total, trainable, located.kind)


def _vocab_size(tokenizer: Any) -> int:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.vocab_size
    return len(tokenizer)
