"""Argument checking shared by every backend, and the frozen loss specification they receive.

Every backend's op validates its arguments through these helpers, so a bad argument raises the
same typed error whichever backend was selected. Only shapes, dtypes and Python values are
inspected: nothing here reads tensor data (safe inside ``vmap`` and under ``torch.compile``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "APPROXIMATIONS",
    "REDUCTIONS",
    "LossSpec",
    "check_approximate",
    "check_ce_tensors",
    "check_chunk_size",
    "check_lce_tensors",
    "check_pointwise_tensors",
    "check_rms_norm_args",
    "check_rope_tensors",
    "finish_loss",
    "loss_spec",
]

#: the reductions every cross-entropy op accepts
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none", "per_example")
#: the GELU forms ``geglu`` accepts (as ``torch.nn.functional.gelu``'s ``approximate``)
APPROXIMATIONS: tuple[str, ...] = ("none", "tanh")


@dataclass(frozen=True)
class LossSpec:
    """What a cross-entropy kernel computes, in the form kernels consume (hashable, frozen).

    ``reduction`` is the kernel-level reduction: ``"none"`` (one loss per token), ``"sum"`` or
    ``"mean"`` over each of ``n_seg`` equal, contiguous segments of the flattened tokens (the
    user-facing ``"sum"``/``"mean"`` use one segment; ``"per_example"`` uses one segment per
    example; ``vmap`` folding multiplies the segment count by the batch size). ``mult`` is
    ``logit_scale / logit_divisor`` (None when neither is given).

    Example:
        >>> spec = LossSpec(-100, "mean", 1, None, None, 0.0)
        >>> spec.folded(4).n_seg
        4
    """

    ignore_index: int
    reduction: str
    n_seg: int
    mult: float | None
    softcap: float | None
    smoothing: float

    def folded(self, batch: int) -> LossSpec:
        """The spec for *batch* copies of these tokens laid end to end (``vmap`` folding)."""
        return replace(self, n_seg=self.n_seg * batch)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(
            f"{name} must be a real number, got {type(value).__name__}: {value!r}."
        )
    out = float(value)
    if not math.isfinite(out):
        raise ConfigurationError(f"{name}={value!r}: expected a finite number.")
    return out


def loss_spec(
    labels_shape: tuple[int, ...],
    *,
    ignore_index: int,
    reduction: str,
    logit_scale: float | None,
    logit_divisor: float | None,
    softcap: float | None,
    label_smoothing: float,
) -> LossSpec:
    """Validate the loss options and build the :class:`LossSpec` for labels of *labels_shape*.

    >>> loss_spec((2, 3), ignore_index=-100, reduction="per_example", logit_scale=None,
    ...           logit_divisor=2.0, softcap=None, label_smoothing=0.1)
    LossSpec(ignore_index=-100, reduction='mean', n_seg=2, mult=0.5, softcap=None, smoothing=0.1)
    """
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise InputTypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__}: {ignore_index!r}."
        )
    if reduction not in REDUCTIONS:
        raise ConfigurationError(
            f"reduction={reduction!r}: expected one of {REDUCTIONS} ('per_example' averages each "
            "example's non-ignored tokens over the leading dimension)."
        )
    mult: float | None = None
    if logit_scale is not None:
        mult = _real("logit_scale", logit_scale)
        if mult == 0.0:
            raise ConfigurationError("logit_scale=0 would zero every logit; pass None instead.")
    if logit_divisor is not None:
        div = _real("logit_divisor", logit_divisor)
        if div == 0.0:
            raise ConfigurationError("logit_divisor=0: cannot divide the logits by zero.")
        mult = (1.0 if mult is None else mult) / div
    cap: float | None = None
    if softcap is not None:
        cap = _real("softcap", softcap)
        if cap <= 0.0:
            raise ConfigurationError(
                f"softcap={softcap!r}: expected a positive number (Gemma 2 uses 30.0) or None."
            )
    eps = _real("label_smoothing", label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ConfigurationError(f"label_smoothing={label_smoothing!r}: expected 0 <= value <= 1.")
    n_seg = 1
    kernel_reduction = reduction
    if reduction == "per_example":
        if len(labels_shape) < 2:
            raise ConfigurationError(
                f"reduction='per_example' needs labels of shape (batch, tokens...), got shape "
                f"{tuple(labels_shape)}; for a single example use reduction='mean'."
            )
        n_seg = int(labels_shape[0])
        kernel_reduction = "mean"
    return LossSpec(ignore_index, kernel_reduction, n_seg, mult, cap, eps)


def _check_tensor(name: str, value: object) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    return value


def _check_float(name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        raise InputTypeError(
            f"{name} must be a floating-point tensor (float32, float16 or bfloat16), got {t.dtype}."
        )


def _check_labels(labels: object, expected: tuple[int, ...], what: str) -> torch.Tensor:
    labels = _check_tensor("labels", labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == _bool():
        raise InputTypeError(
            f"labels must be an integer tensor of class indices, got {labels.dtype}."
        )
    if tuple(labels.shape) != expected:
        raise ConfigurationError(
            f"labels has shape {tuple(labels.shape)}; expected {expected} ({what})."
        )
    return labels


def _bool() -> torch.dtype:
    import torch

    return torch.bool


def check_lce_tensors(
    hidden: object, weight: object, labels: object, bias: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check ``hidden (..., H)``, ``weight (V, H)``, ``bias (V,)``, ``labels (...)``."""
    hidden = _check_tensor("hidden", hidden)
    weight = _check_tensor("weight", weight)
    _check_float("hidden", hidden)
    if hidden.dim() < 1:
        raise ConfigurationError("hidden must have a last (hidden-size) dimension, got a scalar.")
    if weight.dim() != 2:
        raise ConfigurationError(
            f"weight must be 2-D (vocab, hidden) like lm_head.weight, got shape "
            f"{tuple(weight.shape)}."
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ConfigurationError(
            f"weight has shape {tuple(weight.shape)} but hidden's last dimension is "
            f"{hidden.shape[-1]}; expected weight of shape (vocab, {hidden.shape[-1]})."
        )
    if weight.dtype != hidden.dtype:
        raise InputTypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast them to one dtype."
        )
    if weight.shape[0] == 0:
        raise ConfigurationError("weight has an empty vocabulary (shape[0] == 0).")
    if bias is not None:
        bias = _check_tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ConfigurationError(
                f"bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)."
            )
        if bias.dtype != hidden.dtype:
            raise InputTypeError(f"bias is {bias.dtype}; expected {hidden.dtype} like hidden.")
    if hidden.device != weight.device or (bias is not None and bias.device != hidden.device):
        raise ConfigurationError("hidden, weight and bias must be on the same device.")
    labels = _check_labels(labels, tuple(hidden.shape[:-1]), "hidden.shape[:-1]")
    if labels.device != hidden.device:
        raise ConfigurationError(
            f"labels is on {labels.device} but hidden is on {hidden.device}; move them together."
        )
    return hidden, weight, labels, bias


def check_ce_tensors(logits: object, labels: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``logits (..., V)`` and ``labels (...)``."""
    logits = _check_tensor("logits", logits)
    _check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ConfigurationError(
            f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}."
        )
    labels = _check_labels(labels, tuple(logits.shape[:-1]), "logits.shape[:-1]")
    if labels.device != logits.device:
        raise ConfigurationError(
            f"labels is on {labels.device} but logits is on {logits.device}; move them together."
        )
    return logits, labels


def check_chunk_size(chunk_size: object) -> bool | int:
    """``True`` (automatic), ``False``/``0`` (one tile) or a positive int (vocab tile cap)."""
    if isinstance(chunk_size, bool):
        return chunk_size
    if not isinstance(chunk_size, int):
        raise InputTypeError(
            f"chunk_size must be True (automatic tiling), False/0 (no tiling) or a positive int "
            f"(maximum vocabulary tile width), got {type(chunk_size).__name__}: {chunk_size!r}."
        )
    if chunk_size < 0:
        raise ConfigurationError(
            f"chunk_size={chunk_size}: expected True, False/0 or a positive vocabulary tile width."
        )
    return chunk_size


def check_rms_norm_args(x: object, weight: object, eps: object, offset: object) -> None:
    """Check ``x (..., D)``, ``weight (D,)`` or None, ``eps > 0`` and a finite ``offset``."""
    x = _check_tensor("x", x)
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ConfigurationError(f"x must have a non-empty last dimension, got {tuple(x.shape)}.")
    if weight is not None:
        weight = _check_tensor("weight", weight)
        _check_float("weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ConfigurationError(
                f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},) to match "
                "x's last dimension."
            )
        if weight.device != x.device:
            raise ConfigurationError("x and weight must be on the same device.")
    if _real("eps", eps) <= 0.0:
        raise ConfigurationError(f"eps={eps!r}: expected a small positive number such as 1e-6.")
    _real("offset", offset)


def check_pointwise_tensors(gate: object, up: object) -> None:
    """Check that ``gate`` and ``up`` are floating tensors of one shape, dtype and device."""
    gate = _check_tensor("gate", gate)
    up = _check_tensor("up", up)
    _check_float("gate", gate)
    _check_float("up", up)
    if gate.shape != up.shape:
        raise ConfigurationError(
            f"gate has shape {tuple(gate.shape)} but up has shape {tuple(up.shape)}; they must "
            "match (both are projections of the same input)."
        )
    if gate.dtype != up.dtype:
        raise InputTypeError(f"gate is {gate.dtype} but up is {up.dtype}; use one dtype.")
    if gate.device != up.device:
        raise ConfigurationError("gate and up must be on the same device.")


def check_approximate(approximate: object) -> str:
    """Check ``approximate`` is ``"none"`` (exact erf GELU) or ``"tanh"``; return the kind."""
    if approximate not in APPROXIMATIONS:
        raise ConfigurationError(
            f"approximate={approximate!r}: expected 'none' (exact GELU) or 'tanh' (Gemma's)."
        )
    return "gelu" if approximate == "none" else "gelu_tanh"


def check_rope_tensors(x: object, cos: object, sin: object) -> None:
    """Check ``x (..., D)`` with even ``D`` and ``cos``/``sin`` broadcastable to ``x``."""
    import torch

    x = _check_tensor("x", x)
    cos = _check_tensor("cos", cos)
    sin = _check_tensor("sin", sin)
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _check_float(name, t)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ConfigurationError(
            f"x must have an even last (head) dimension, got shape {tuple(x.shape)}."
        )
    if cos.shape != sin.shape:
        raise ConfigurationError(
            f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match."
        )
    try:
        # torch leaves broadcast_shapes unannotated: its signature, stated
        broadcast_shapes: Callable[..., torch.Size] = torch.broadcast_shapes
        shape = broadcast_shapes(x.shape, cos.shape)
    except RuntimeError as err:
        raise ConfigurationError(
            f"cos/sin of shape {tuple(cos.shape)} do not broadcast to x of shape "
            f"{tuple(x.shape)}: {err}."
        ) from err
    if shape != x.shape or cos.shape[-1] != x.shape[-1]:
        raise ConfigurationError(
            f"cos/sin of shape {tuple(cos.shape)} must broadcast to x's shape {tuple(x.shape)} "
            f"without enlarging it and have the same last dimension ({x.shape[-1]})."
        )
    if cos.device != x.device or sin.device != x.device:
        raise ConfigurationError("x, cos and sin must be on the same device.")


def finish_loss(out: torch.Tensor, reduction: str, labels_shape: tuple[int, ...]) -> torch.Tensor:
    """Shape a kernel's flat result like the user-facing reduction promises."""
    if reduction == "none":
        return out.reshape(labels_shape)
    if reduction == "per_example":
        return out
    return out.reshape(())
