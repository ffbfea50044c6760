"""Arguments of the per-example linear cross-entropy gradients: checks, the per-token loss
spec, the tiles and the route (shared by :mod:`._example_grads` and :mod:`._recorded`)."""

from __future__ import annotations

import torch

from opake.core.errors import ConfigurationError, InputTypeError
from opake.kernels._args import LossSpec, check_lce_tensors, loss_spec
from opake.kernels.chunked._workspace import resolve_chunking

__all__ = [
    "ROUTES",
    "kept_ghost_is_cheaper",
    "lce_ghost_is_cheaper",
    "prepare",
    "token_grads_of",
]

Tensor = torch.Tensor
_F32 = torch.float32
ROUTES = ("auto", "ghost", "materialised")


def lce_ghost_is_cheaper(steps: int, hidden: int, vocab: int) -> bool:
    """Whether the Gram route costs fewer multiply-adds than the per-example tiles.

    Per example the Gram route costs ``T²·(V + H)`` (``d`` and ``h`` Gram matrices), the
    materialised route ``T·V·H`` (each tile's ``vt × H`` gradient); both recompute the logits
    (``T·V·H``) anyway. So the ghost norm wins while ``T·(V + H) ≤ V·H``, i.e. up to
    ``T ≈ H`` for a large vocabulary.

    >>> lce_ghost_is_cheaper(64, 256, 4096), lce_ghost_is_cheaper(512, 256, 4096)
    (True, False)
    """
    return steps * (vocab + hidden) <= vocab * hidden


def kept_ghost_is_cheaper(steps: int, hidden: int, vocab: int) -> bool:
    """Whether the Gram route is the faster one when the forward kept the logit gradients.

    Nothing is recomputed then, and the two routes' products differ in shape: the Gram route
    is one batched product with the vocabulary as its inner dimension and yields the token
    norms as its diagonal; the materialised route forms each example's ``V × H`` gradient by a
    product with only ``T`` as its inner dimension, writes and reads it back to square it, and
    reads ``u`` again for the token norms. Per multiply-add the Gram route ran about twice as
    fast on CPU at 1 thread (``T = 63, V = 1024, H = 64``: 12.7 ms against 25.2 ms; at
    ``T·(V + H) = 2.1·V·H`` still 14.5 against 21.2 ms; at ``4.2·V·H`` 23 against 18 ms), so it
    is chosen while ``T·(V + H) ≤ 2·V·H``.

    >>> lce_ghost_is_cheaper(63, 64, 1024), kept_ghost_is_cheaper(63, 64, 1024)
    (False, True)
    """
    return steps * (vocab + hidden) <= 2 * vocab * hidden


def _none_spec(spec: LossSpec) -> LossSpec:
    return LossSpec(spec.ignore_index, "none", 1, spec.mult, spec.softcap, spec.smoothing)


def prepare(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    *,
    ignore_index: int,
    logit_scale: float | None,
    logit_divisor: float | None,
    softcap: float | None,
    label_smoothing: float,
    chunk_size: bool | int,
    route: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, LossSpec, tuple[int, int] | None, str]:
    """Check the arguments; the per-token loss spec, the tiles and the resolved route."""
    hidden, weight, labels, bias = check_lce_tensors(hidden, weight, labels, bias)
    if hidden.dim() != 3:
        raise ConfigurationError(
            f"hidden of shape {tuple(hidden.shape)}: expected (batch, tokens, hidden) — the "
            "per-example gradients need the batch on dimension 0"
        )
    if route not in ROUTES:
        raise ConfigurationError(f"route={route!r}: expected one of {ROUTES}")
    spec = _none_spec(
        loss_spec(
            tuple(labels.shape),
            ignore_index=ignore_index,
            reduction="none",
            logit_scale=logit_scale,
            logit_divisor=logit_divisor,
            softcap=softcap,
            label_smoothing=label_smoothing,
        )
    )
    batch, steps, hsize = hidden.shape
    vocab = weight.shape[0]
    if route == "auto":
        route = "ghost" if lce_ghost_is_cheaper(steps, hsize, vocab) else "materialised"
    tiles = resolve_chunking(
        chunk_size, hidden.device, hsize, vocab, hidden.dtype, tokens=max(1, batch * steps)
    )
    return hidden, weight, labels, bias, spec, tiles, route


def token_grads_of(token_grads: object, labels: Tensor, ignore_index: int) -> Tensor:
    """fp32 upstream gradients, zero on ignored tokens (a NaN handed to one cannot leak in)."""
    if not isinstance(token_grads, torch.Tensor):
        raise InputTypeError(
            f"token_grads must be a tensor of shape {tuple(labels.shape)}, got "
            f"{type(token_grads).__name__}"
        )
    if tuple(token_grads.shape) != tuple(labels.shape):
        raise ConfigurationError(
            f"token_grads of shape {tuple(token_grads.shape)}; expected {tuple(labels.shape)} "
            "(one upstream gradient per token, like labels)"
        )
    return torch.where(labels != ignore_index, token_grads.detach().to(_F32), 0.0)
