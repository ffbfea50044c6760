"""transformers' data-dependent input checks, made safe inside the per-example forward.

Some transformers models inspect the *values* of their inputs before running, to warn about a
likely mistake: ``PreTrainedModel.warn_if_padding_and_no_attention_mask`` (GPT-2 and others)
asks whether ``pad_token_id`` is among the first or last tokens when no attention mask is given.
Under ``vmap`` (the per-example engine, chosen when dropout is active) such a question cannot be
answered — each example holds a different value — and torch raises ("vmap: ... .item()").

The check is a warning only, and ``DPTrainer``'s collator already handles padding (labels -100 on
padding, no mask needed after right padding in a causal LM, a float additive mask otherwise), so
inside a ``torch.func`` transform it is skipped; outside one it runs unchanged. While
``torch.compile`` traces (``torch_compile=True``: the DP step, inside ``vmap``) it is skipped
too: asking torch whether a transform is active (``maybe_current_level``) returns an int that
Dynamo cannot put in a graph, so the question itself would break the compiled step. Only the
model instance given to ``DPTrainer`` (and its submodules) is changed, never a class.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from opake.functional import outside_transforms

__all__ = ["DATA_DEPENDENT_CHECKS", "make_checks_transform_safe"]

logger = logging.getLogger("opake.transformers")

#: the transformers methods that branch on input values and only warn (model instance level)
DATA_DEPENDENT_CHECKS = ("warn_if_padding_and_no_attention_mask",)
#: set on every check :func:`_safe` made (so making one safe twice is a no-op)
_SAFE = "_opake_transform_safe_check"


def _safe(check: Callable[..., Any]) -> Callable[..., Any]:
    """*check* skipped inside ``torch.func`` transforms and while ``torch.compile`` traces."""
    if getattr(check, _SAFE, False):
        return check
    outside = outside_transforms(check)

    @functools.wraps(outside)
    def skipped_when_traced(*args: Any, **kwargs: Any) -> object:
        import torch

        if torch.compiler.is_compiling():  # a constant to Dynamo: nothing else is traced
            return None
        return outside(*args, **kwargs)

    setattr(skipped_when_traced, _SAFE, True)
    return skipped_when_traced


def make_checks_transform_safe(model: Any) -> int:
    """Make each of :data:`DATA_DEPENDENT_CHECKS` a no-op inside ``torch.func`` transforms (and
    while ``torch.compile`` traces) on every submodule of ``model`` that has it (idempotent);
    return how many were changed.

    >>> import torch
    >>> class Model(torch.nn.Module):
    ...     def warn_if_padding_and_no_attention_mask(self, input_ids, attention_mask):
    ...         return bool(0 in input_ids)
    >>> model = Model()
    >>> make_checks_transform_safe(model), make_checks_transform_safe(model)
    (1, 0)
    >>> model.warn_if_padding_and_no_attention_mask(torch.tensor([[0, 1]]), None)
    True
    >>> torch.func.vmap(lambda x: (model.warn_if_padding_and_no_attention_mask(x, None), x)[1])(
    ...     torch.tensor([[0, 1]])).tolist()
    [[0, 1]]
    """
    changed = 0
    for module in model.modules():
        for name in DATA_DEPENDENT_CHECKS:
            check = getattr(module, name, None)
            if check is None:
                continue
            safe = _safe(check)
            if safe is not check:
                setattr(module, name, safe)
                changed += 1
    if changed:
        logger.debug(
            "transformers' padding check skipped inside the per-example forward (%d module(s)): "
            "it branches on token values, and DPTrainer's collator handles padding itself",
            changed,
        )
    return changed
