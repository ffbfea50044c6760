"""Position encodings that depend on the batch: one record would change every other record's
gradient.

Hugging Face's rotary embeddings of ``rope_type`` ``"dynamic"`` (dynamic NTK scaling) and
``"longrope"`` (Phi-3-128k, Phi-3.5, Phi-4-mini) choose their frequencies from the longest
position of the *batch* they run on (``max(position_ids) + 1``; ``"dynamic"`` also keeps the
longest seen so far). Batches are padded to their longest record, so under such an embedding
adding or removing one long record changes every other record's gradient — the clipped sum
moves by many times the clipping norm, whatever the clipping does (a review measured 11·C on a
Phi-3 model). The DP front ends refuse these models (:func:`length_dependent_rope`).
"""

from __future__ import annotations

from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["check_positions", "length_dependent_rope"]


def _depends_on_length(rope_type: object) -> bool:
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def length_dependent_rope(model: Any) -> str | None:
    """The ``rope_type`` of a rotary embedding in ``model`` whose frequencies depend on the
    batch's sequence length (``"dynamic"``, ``"longrope"``, ...), or ``None``.

    Read from every submodule's ``rope_type`` and from the configurations' ``rope_parameters``
    / ``rope_scaling`` (a model wrapped by PEFT included).

    >>> import torch
    >>> length_dependent_rope(torch.nn.Linear(2, 2)) is None
    True
    """
    import torch

    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        rope_type = getattr(module, "rope_type", None)
        if _depends_on_length(rope_type):
            return str(rope_type)
        config = getattr(module, "config", None)
        for field in ("rope_parameters", "rope_scaling"):
            params = getattr(config, field, None)
            if isinstance(params, dict):
                found = params.get("rope_type", params.get("type"))
                if _depends_on_length(found):
                    return str(found)
    return None


def check_positions(model: Any, owner: str) -> None:
    """Raise :class:`~opake.core.errors.ConfigurationError` for a model whose rotary embedding
    depends on the batch's sequence length (see the module docstring)."""
    rope_type = length_dependent_rope(model)
    if rope_type is None:
        return
    raise ConfigurationError(
        f"{owner}: the model's rotary embedding has rope_type={rope_type!r}, whose frequencies "
        "depend on the longest sequence of each batch: one long record would change every "
        "other record's gradient, which per-example clipping cannot bound, and the reported ε "
        "would not hold. Use a fixed rotary embedding (set config.rope_parameters' rope_type "
        "to 'default', or 'linear'/'yarn' with a fixed factor, before loading the weights)"
    )
