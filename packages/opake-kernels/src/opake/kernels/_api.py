"""Public entry points: pick a backend per call, then run its implementation of the op.

Selection (``opake.core.plugins.select_kernel``): the explicit ``backend`` argument, then
``OPAKE_KERNEL_BACKEND``, then the available backend of highest priority for the input's device,
then the ``torch`` reference. An explicit backend that cannot run raises ``OperationError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opake.core import ops
from opake.core.errors import InputTypeError
from opake.core.plugins import KernelChoice, select_kernel

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping import ImplicitGrad

__all__ = [
    "clip_accumulate",
    "cross_entropy",
    "geglu",
    "kernel_choice",
    "linear_cross_entropy",
    "linear_cross_entropy_example_grads",
    "rms_norm",
    "rope",
    "swiglu",
]


def _device_of(name: str, value: object) -> object:
    import torch

    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    return value.device


def _impl(op: str, name: str, value: object, backend: str | None) -> Callable[..., Any]:
    if backend is not None and not isinstance(backend, str):
        raise InputTypeError(
            f"backend must be None or a backend name such as 'chunked', got "
            f"{type(backend).__name__}: {backend!r}."
        )
    return select_kernel(op, _device_of(name, value), backend).impl


def kernel_choice(op: str, device: object = None, backend: str | None = None) -> KernelChoice:
    """Which backend would run *op* on *device*, and why (nothing is executed).

    >>> kernel_choice("rms_norm", "cpu", backend="torch").backend
    'torch'
    """
    return select_kernel(op, device, backend)


def clip_accumulate(
    grads: Sequence[torch.Tensor],
    factors: torch.Tensor,
    sums: Sequence[torch.Tensor],
    *,
    backend: str | None = None,
) -> str:
    """``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` in place, for every leaf ``j``.

    The vmap clipping engine's scale-and-sum: ``grads[j]`` is ``[m, *shape_j]`` (per-example
    gradients of leaf ``j``), ``factors`` ``[m, leaves]`` (each example's clipping factor per
    leaf, 0 for an example that must not contribute), ``sums[j]`` the fp32 ``shape_j``
    accumulator. Non-finite gradient entries are read as 0, so a zero factor always removes an
    example. The ``triton`` backend does every leaf in one launch per dtype; the others run the
    reference. Returns the name of the path that ran (``"triton"`` or ``"torch"``).

    >>> import torch
    >>> from opake.kernels import clip_accumulate
    >>> sums = [torch.zeros(2)]
    >>> clip_accumulate([torch.tensor([[1.0, float("nan")], [3.0, 4.0]])],
    ...                 torch.tensor([[0.5], [1.0]]), sums, backend="torch")
    'torch'
    >>> sums[0].tolist()
    [3.5, 4.0]
    """
    from opake.kernels.torch._clip import check_clip_args

    check_clip_args(grads, factors, sums)
    where = sums[0] if sums else factors  # the accumulators' device decides
    impl = _impl(ops.CLIP_ACCUMULATE, "sums", where, backend)
    return str(impl(grads, factors, sums))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against *labels*, without the full logits.

    Args:
        hidden: ``(..., H)`` final hidden states (float32, float16 or bfloat16).
        weight: ``(V, H)`` output projection (``lm_head.weight``), same dtype as *hidden*.
        labels: ``(...)`` integer class indices, ``hidden.shape[:-1]``; already shifted for
            causal LM training.
        bias: optional ``(V,)`` output bias.
        ignore_index: label value that contributes no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when there are none), ``"sum"``,
            ``"none"`` (one loss per token) or ``"per_example"`` (``(batch,)``: each example's
            mean over its own non-ignored tokens). Called on one example under ``vmap``,
            ``"mean"`` *is* the per-example reduction: no count is shared across examples.
        logit_scale: multiply the logits (Cohere).
        logit_divisor: divide the logits (Granite).
        softcap: ``softcap * tanh(logits / softcap)`` (Gemma 2), after scale and divisor.
        label_smoothing: as ``torch.nn.functional.cross_entropy``'s.
        chunk_size: tiling of the ``chunked`` backend: ``True`` automatic, an int caps the
            vocabulary tile width, ``False``/``0`` one tile. Other backends ignore it.
        backend: ``None`` (automatic), ``"torch"``, ``"chunked"``, ``"triton"`` or a plugin's.

    Returns:
        The fp32 loss, shaped by *reduction*.

    Example:
        >>> import torch
        >>> from opake.kernels import linear_cross_entropy
        >>> h, w = torch.zeros(2, 3, 4), torch.zeros(5, 4)
        >>> labels = torch.tensor([[0, 1, -100], [2, -100, -100]])
        >>> linear_cross_entropy(h, w, labels, reduction="per_example").tolist()
        [1.6094379425048828, 1.6094379425048828]
    """
    impl = _impl(ops.LINEAR_CROSS_ENTROPY, "hidden", hidden, backend)
    out: torch.Tensor = impl(
        hidden,
        weight,
        labels,
        bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
    )
    return out


def linear_cross_entropy_example_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_grads: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
    route: str = "auto",
    backend: str | None = None,
) -> ImplicitGrad:
    """Per-example gradients of *weight* (and *bias*) in :func:`linear_cross_entropy`, implicit.

    Example ``i``'s gradient of ``Σ_t token_grads[i, t] · loss[i, t]`` is never formed: the
    returned object computes, vocabulary tile by vocabulary tile, each example's squared norm
    (``sq_norms()``), the weighted sum ``Σ_i w_i G_i`` (``weighted_sum(w)``) and inner products
    with another use of the same matrix (``inner_outer(ids_or_rows, b)``, e.g. a tied input
    embedding). The book-keeping clipping engine uses it to clip with a loss-only forward.

    Args:
        hidden: ``(B, T, H)`` final hidden states (batch first).
        weight: ``(V, H)`` output projection.
        labels: ``(B, T)`` targets (already shifted), ``ignore_index`` for none.
        token_grads: ``(B, T)`` upstream gradient of each token's loss (``1/count_i`` for
            example ``i``'s mean loss).
        bias: optional ``(V,)`` output bias.
        logit_scale: as :func:`linear_cross_entropy`.
        logit_divisor: as :func:`linear_cross_entropy`.
        softcap: as :func:`linear_cross_entropy`.
        label_smoothing: as :func:`linear_cross_entropy`.
        chunk_size: as :func:`linear_cross_entropy`.
        route: ``"ghost"`` (Gram matrices of the logit gradients and of the hidden states),
            ``"materialised"`` (one ``vocab_tile × H`` gradient tile at a time) or ``"auto"``
            (the cheaper one, ``T·(V + H) ≤ V·H`` for the Gram route).
        backend: ``None`` (automatic: ``chunked``, which runs on every device) or a backend
            that implements the op.

    Example:
        >>> import torch
        >>> from opake.kernels import linear_cross_entropy_example_grads
        >>> h, w = torch.ones(2, 3, 4), torch.zeros(5, 4)
        >>> y, g = torch.tensor([[0, 1, 2], [3, 4, -100]]), torch.ones(2, 3)
        >>> grads = linear_cross_entropy_example_grads(h, w, y, g)
        >>> [round(x, 4) for x in grads.sq_norms()[0].tolist()]  # ‖h‖²·‖Σ_t (p_t - onehot_t)‖²
        [4.8, 4.8]
    """
    impl = _impl(ops.LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS, "hidden", hidden, backend)
    grads: ImplicitGrad = impl(
        hidden,
        weight,
        labels,
        token_grads,
        bias=bias,
        ignore_index=ignore_index,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
        route=route,
    )
    return grads


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy on ``(..., V)`` logits; same options and reductions as
    :func:`linear_cross_entropy`. The loss is fp32 whatever the logits' dtype.

    >>> import torch
    >>> from opake.kernels import cross_entropy
    >>> round(cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)
    1.3863
    """
    impl = _impl(ops.CROSS_ENTROPY, "logits", logits, backend)
    out: torch.Tensor = impl(
        logits,
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm ``x / sqrt(mean(x²) + eps) * (offset + weight)`` in fp32, cast to ``x.dtype``.

    ``offset=1.0`` is Gemma's ``(1 + weight)``; ``weight=None`` normalises only.

    >>> import torch
    >>> from opake.kernels import rms_norm
    >>> rms_norm(torch.full((1, 2), 2.0), torch.ones(2), eps=1e-12).tolist()
    [[1.0, 1.0]]
    """
    impl = _impl(ops.RMS_NORM, "x", x, backend)
    out: torch.Tensor = impl(x, weight, eps=eps, offset=offset)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (Llama/Mistral/Qwen MLPs), fp32 math, result in the inputs' dtype.

    >>> import torch
    >>> from opake.kernels import swiglu
    >>> swiglu(torch.zeros(2), torch.ones(2)).tolist()
    [0.0, 0.0]
    """
    impl = _impl(ops.SWIGLU, "gate", gate, backend)
    out: torch.Tensor = impl(gate, up)
    return out


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: str = "none",
    backend: str | None = None,
) -> torch.Tensor:
    """``gelu(gate) * up``: exact erf GELU, or ``approximate="tanh"`` (Gemma's tanh GELU).

    >>> import torch
    >>> from opake.kernels import geglu
    >>> geglu(torch.zeros(2), torch.ones(2), approximate="tanh").tolist()
    [0.0, 0.0]
    """
    impl = _impl(ops.GEGLU, "gate", gate, backend)
    out: torch.Tensor = impl(gate, up, approximate=approximate)
    return out


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """Rotary position embedding ``x·cos + rotate_half(x)·sin`` (Hugging Face layout).

    Apply it to queries and keys separately; ``cos``/``sin`` (``(..., seq, head_dim)``) must
    broadcast to ``x`` without enlarging it.

    >>> import torch
    >>> from opake.kernels import rope
    >>> rope(torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2), torch.ones(1, 2)).tolist()
    [[-2.0, 1.0]]
    """
    impl = _impl(ops.ROPE, "x", x, backend)
    out: torch.Tensor = impl(x, cos, sin)
    return out
