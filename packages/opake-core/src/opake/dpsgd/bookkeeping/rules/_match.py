"""Shared predicates of the built-in rules' ``matches``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["embed_scale", "is_conv1d", "plain"]


def plain(module: torch.nn.Module, base: type[torch.nn.Module]) -> bool:
    """``module`` is a ``base`` that runs ``base.forward`` (a subclass overriding ``forward``,
    e.g. a scaled embedding, computes something else: its closed-form rule would be wrong).

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> plain(layer, torch.nn.Linear), plain(layer, torch.nn.Embedding)
    (True, False)
    """
    return isinstance(module, base) and type(module).forward is base.forward


def is_conv1d(module: torch.nn.Module) -> bool:
    """``module`` is GPT-2's ``Conv1D`` (a linear map with a transposed ``[in, out]`` weight)."""
    import torch

    cls = type(module)
    weight = getattr(module, "weight", None)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers")
        and hasattr(module, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def embed_scale(module: torch.nn.Module) -> torch.Tensor | float | None:
    """The factor of a Hugging Face ``*ScaledWordEmbedding`` (``embedding(ids) * embed_scale``),
    or None for any other module."""
    import torch

    if not (
        isinstance(module, torch.nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and type(module).__module__.startswith("transformers")
    ):
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    return scale if isinstance(scale, float) else None
