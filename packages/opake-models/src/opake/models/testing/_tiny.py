"""Build the tiny model a family spec describes (no download)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.models._registry import family_spec
from opake.models._spec import FamilySpec

if TYPE_CHECKING:
    import torch

__all__ = ["tiny_model"]


def tiny_model(
    family: str | FamilySpec,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
    **overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised task model of ``family`` from its ``tiny_config``, in eval mode.

    ``overrides`` change config arguments (``hidden_act="gelu"``, ``tie_word_embeddings=False``).
    Eager attention is the default: under ``vmap`` transformers' SDPA path falls back to a slow
    per-example loop (with a warning).

    >>> from opake.models.testing import tiny_model
    >>> type(tiny_model("gpt2")).__name__
    'GPT2LMHeadModel'
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = family_spec(family) if isinstance(family, str) else family
    kwargs = {**spec.tiny_config, **overrides}
    config = AutoConfig.for_model(spec.model_types[0], **kwargs)
    auto = AutoModelForCausalLM if spec.task == "causal_lm" else AutoModelForSequenceClassification
    torch.manual_seed(seed)
    # transformers leaves the auto classes' from_config unannotated: its result, stated
    from_config: Callable[..., torch.nn.Module] = auto.from_config
    model = from_config(config, attn_implementation=attn_implementation)
    return model.eval()
