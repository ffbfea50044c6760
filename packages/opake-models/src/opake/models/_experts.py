"""transformers' fused experts modules (``use_experts_implementation``), as Opake reads them.

The MoE adapter (:mod:`opake.models._moe`) and the book-keeping rule
(:mod:`opake.models.bookkeeping`) read the same attributes of these modules; torch types every
module attribute as a tensor or a submodule (``nn.Module.__getattr__``), which these are not all,
so both read them through :class:`FusedExperts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch

__all__ = ["FusedExperts", "fused_experts"]


class FusedExperts(Protocol):
    """A fused experts module: ``[E, ...]`` projection tensors and how each expert uses them.

    The optional members exist where the module's flag says so: ``_apply_gate`` with
    ``has_gate`` (else ``act_fn``), ``down_proj_bias`` with ``has_bias``, ``post_expert_norm``
    with ``has_post_expert_norm``.
    """

    num_experts: int
    down_proj: torch.Tensor
    down_proj_bias: torch.Tensor

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor: ...

    def act_fn(self, h: torch.Tensor) -> torch.Tensor: ...

    def post_expert_norm(self, h: torch.Tensor) -> torch.Tensor: ...


def fused_experts(module: torch.nn.Module) -> FusedExperts:
    """``module`` read as :class:`FusedExperts` (the same object).

    A cast, because a Protocol of attributes cannot be checked without reading them: the
    callers pass modules already checked (:func:`opake.models._moe.install_moe`,
    :func:`opake.models.bookkeeping.supports_recording`) or built as such.

    >>> import torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> fused_experts(lin) is lin
    True
    """
    return cast("FusedExperts", module)
