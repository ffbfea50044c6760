"""Saving the trained model of ``opake train`` so that it loads back as it was trained.

Without LoRA, ``model/`` is the model's ``save_pretrained`` output. With LoRA (a PEFT model):

- ``model/`` — the **merged** model (adapters folded into the weights): a plain Hugging Face
  directory that ``from_pretrained`` and ``opake train --model`` load as is;
- ``adapter/`` — the adapter alone (PEFT ``save_pretrained``), whose ``base_model_name_or_path``
  names the base it belongs to;
- ``base_model/`` — when the base exists nowhere else as a Hugging Face directory (a named
  config's random initialisation, a de-quantised GGUF file): the base weights under their plain
  names (PEFT's wrapped ``*.base_layer.weight`` names would make ``from_pretrained`` re-initialise
  every adapted layer).

Every directory also holds the tokenizer.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

__all__ = ["save_run_model", "save_trained_model"]


def save_trained_model(
    out: Path, model: Any, tokenizer: Any, *, base: str | None, save_base: bool
) -> dict[str, str]:
    """Write ``model/`` (and with LoRA ``adapter/``, ``base_model/``) into *out*.

    Args:
        out: the run's output directory.
        model: the trained model; a PEFT model is merged **in place** (it is consumed).
        tokenizer: saved next to every model directory.
        base: how the adapter's base is recorded when *save_base* is false (the source the user
            gave: a directory or a Hub id).
        save_base: also write the clean base into ``base_model/``.

    Returns:
        ``{"model": path, ...}``: the directories written.
    """
    with warnings.catch_warnings():
        # peft and transformers deprecate each other's helpers; not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        if not hasattr(model, "peft_config"):
            return {"model": _save(model, tokenizer, out / "model")}
        return _save_lora(out, model, tokenizer, base=base, save_base=save_base)


def _save(model: Any, tokenizer: Any, target: Path, **kwargs: Any) -> str:
    model.save_pretrained(target, **kwargs)
    tokenizer.save_pretrained(target)
    return str(target)


def _save_lora(
    out: Path, model: Any, tokenizer: Any, *, base: str | None, save_base: bool
) -> dict[str, str]:
    saved: dict[str, str] = {}
    base_dir = out / "base_model"
    for config in model.peft_config.values():
        config.base_model_name_or_path = str(base_dir.resolve()) if save_base else base
    # the embeddings are not adapted (all-linear LoRA): no need to look for the base's config
    saved["adapter"] = _save(model, tokenizer, out / "adapter", save_embedding_layers=False)
    clean: dict[str, Any] | None = None
    if save_base:
        # the base weights under their plain names, copied before the merge changes them
        clean = {
            key.replace(".base_layer.", "."): value.detach().clone()
            for key, value in model.get_base_model().state_dict().items()
            if ".lora_" not in key
        }
    merged = model.merge_and_unload()
    saved["model"] = _save(merged, tokenizer, out / "model")
    if clean is not None:
        merged.load_state_dict(clean, strict=True)
        saved["base_model"] = _save(merged, tokenizer, base_dir)
    return saved


def save_run_model(out: Path, loaded: Any, model: Any, tokenizer: Any) -> dict[str, str]:
    """:func:`save_trained_model` for a model built by ``opake.cli._models.load_model``
    (*loaded*): the base is saved when it has no Hugging Face directory of its own."""
    kind = getattr(loaded, "kind", "directory" if loaded.from_directory else "named")
    base = str(Path(loaded.source).resolve()) if kind == "directory" else loaded.source
    return save_trained_model(out, model, tokenizer, base=base, save_base=kind in ("named", "gguf"))
