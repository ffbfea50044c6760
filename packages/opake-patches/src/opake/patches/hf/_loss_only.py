"""The loss-only forward of a causal language model: a loss, no ``(batch, seq, vocab)`` logits.

``model(input_ids, labels=labels, loss_only=True)`` runs the backbone, then the selected
``linear_cross_entropy`` kernel on the final hidden states and the output projection's weight:
the full logits tensor is never materialised. The result is a ``CausalLMOutputWithPast`` whose
``logits`` is ``None``. Calls without ``loss_only=True`` run the model's own forward untouched.

Per-example semantics (DP-SGD clips each example's gradient, so an example's loss must not
depend on the others): an example's loss is the mean over *its own* non-ignored target tokens
(labels shifted by one for next-token prediction). For a batch of several examples the returned
loss is the mean of the per-example losses — never a token mean across the batch, and
``num_items_in_batch`` (a batch-global count) is refused. ``per_example_loss=True`` (with
``loss_only=True``) returns the vector of per-example losses ``[B]`` instead: what a
:class:`~opake.dpsgd.bookkeeping.BatchedLoss` returns.

Under the book-keeping clipping engine (``clipped_grad(engine="bookkeeping" | "auto")``) the
output projection's weight is read without calling its module, so no forward hook sees it: the
forward asks :func:`opake.dpsgd.bookkeeping.implicit_use`, runs the kernel on the *detached*
weight (the backward then computes the hidden states' gradient only) and taps the per-token
losses through the loss backend's ``linear_cross_entropy_recorded`` op (else the one the kernel
selection chooses for the device), whose backward forms the hidden states' gradient and each
example's ``lm_head`` norm in one pass over the vocabulary tiles; the engine then gets the
head's per-example gradients (norms, clipped sum, the cross term of a tied embedding) from it.
The logits never exist, not even for the per-example norms.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core import ops
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.patches._patcher import tag

if TYPE_CHECKING:
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from opake.patches._patcher import Patcher

__all__ = ["LossKernel", "LossOnlyHead", "install_loss_only", "per_example_lm_loss", "resolve_path"]

#: ``aux_loss(model, arguments)``: a context manager around the backbone call that yields None
#: or a function returning each example's auxiliary term ``[B]`` (see :class:`LossOnlyHead`)
AuxLoss = Callable[
    [Any, dict[str, Any]],
    contextlib.AbstractContextManager["Callable[[], torch.Tensor | None] | None"],
]


@dataclass(frozen=True)
class LossOnlyHead:
    """Where a causal LM keeps its head, and how its logits are transformed.

    ``logits = softcap(lm_head(backbone(x).last_hidden_state) · logit_scale / logit_divisor)``
    with ``softcap(z) = cap · tanh(z / cap)``; the kernel applies the same transform inside each
    tile. Numbers, not config attribute names: the family reads them from the instance's config.

    Args:
        lm_head: attribute path of the output projection (a module with ``weight`` and an
            optional ``bias``); a tied head is fine (the weight is shared, its gradient is the
            sum of both uses).
        backbone: attribute path of the decoder stack returning the final (normed) hidden
            states (``"model"``; ``"transformer"`` for GPT-2).
        logit_scale: multiply logits by this (Cohere ``logit_scale``).
        logit_divisor: divide logits by this (Granite ``logits_scaling``).
        softcap: final logit soft-cap (Gemma 2 ``final_logit_softcapping``).
        shift_labels: predict token ``t + 1`` from position ``t`` (causal LM training).
        aux_loss: a per-example auxiliary loss added to each example's loss (a mixture of
            experts' load-balancing loss): ``aux_loss(model, arguments)`` is called before the
            backbone with the backbone's keyword arguments (it may edit them) and returns a
            context manager entered around the backbone call; it yields None (no auxiliary
            loss for this call) or a function returning the ``[B]`` terms after the call. Each
            term must depend on its own example only.

    Example:
        >>> LossOnlyHead(logit_divisor=4.0).kernel_kwargs()
        {'logit_scale': None, 'logit_divisor': 4.0, 'softcap': None}
    """

    lm_head: str = "lm_head"
    backbone: str = "model"
    logit_scale: float | None = None
    logit_divisor: float | None = None
    softcap: float | None = None
    shift_labels: bool = True
    aux_loss: AuxLoss | None = None

    def __post_init__(self) -> None:
        if self.aux_loss is not None and not callable(self.aux_loss):
            raise InputTypeError(
                f"LossOnlyHead(aux_loss={self.aux_loss!r}): expected a callable or None."
            )
        for what in ("lm_head", "backbone"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value or value.startswith("."):
                raise ConfigurationError(
                    f"LossOnlyHead({what}={value!r}): expected an attribute path such as 'model'."
                )
        for what in ("logit_scale", "logit_divisor", "softcap"):
            value = getattr(self, what)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputTypeError(
                    f"LossOnlyHead({what}={value!r}): expected a number or None (read the "
                    "config value in the family, not the attribute name)."
                )
            if what != "logit_scale" and not value > 0:
                raise ConfigurationError(f"LossOnlyHead({what}={value!r}): must be positive.")
            object.__setattr__(self, what, float(value))

    def kernel_kwargs(self) -> dict[str, float | None]:
        """The logit-transform keywords of the ``linear_cross_entropy`` op."""
        return {
            "logit_scale": self.logit_scale,
            "logit_divisor": self.logit_divisor,
            "softcap": self.softcap,
        }


@dataclass(frozen=True)
class LossKernel:
    """The ``linear_cross_entropy`` implementation a loss-only forward calls.

    Attributes:
        backend: kernel backend name (``"torch"``, ``"chunked"``, ``"triton"``, ...).
        impl: the op implementation (``impl(hidden, weight, labels, *, bias, ignore_index,
            reduction, logit_scale, logit_divisor, softcap, label_smoothing, chunk_size)``).
        chunk_size: ``True`` (automatic 2-D tiling), a positive int (cap on the vocabulary tile
            width) or ``False`` (one tile); only the chunked backend tiles by it.
        reason: why this backend was chosen.
    """

    backend: str
    impl: Callable[..., Any]
    chunk_size: bool | int = True
    reason: str = ""


def resolve_path(obj: Any, path: str) -> Any:  # Any: like getattr, whatever the path holds
    """Follow a dotted attribute path (``"model.embed_tokens"``); None where it breaks.

    >>> class A: pass
    >>> a = A(); a.b = A(); a.b.c = 3
    >>> resolve_path(a, "b.c"), resolve_path(a, "b.d")
    (3, None)
    """
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def per_example_lm_loss(
    kernel: LossKernel,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    head: LossOnlyHead | None = None,
    ignore_index: int = -100,
    per_example: bool = False,
    module: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Mean over examples of each example's mean token loss (labels already aligned).

    ``hidden`` is ``(B, T, H)`` (or ``(T, H)``), ``labels`` ``(B, T)`` (or ``(T,)``). With one
    example this is the kernel's own ``reduction="mean"``; with several, the kernel's
    ``reduction="per_example"`` averages each example's own tokens (an example with no target
    token contributes 0), so a kernel that forms the gradients in its forward pass does so here
    too.
    ``per_example=True`` returns those per-example losses ``(B,)`` instead of their mean.
    ``module`` is the layer owning ``weight`` (``lm_head``): while the book-keeping engine
    records a forward it is tapped (see the module docstring).

    >>> import torch
    >>> from opake.patches.hf import LossKernel
    >>> def ref(h, w, y, *, bias=None, ignore_index=-100, reduction="mean", **kw):
    ...     nll = torch.nn.functional.cross_entropy(
    ...         (h @ w.T).flatten(0, -2), y.flatten(), ignore_index=ignore_index, reduction="none")
    ...     nll = nll.view(y.shape)
    ...     if reduction == "per_example":  # each example's mean over its own target tokens
    ...         return nll.sum(-1) / (y != -100).sum(-1).clamp_min(1)
    ...     return nll if reduction == "none" else nll.sum() / (y != -100).sum()
    >>> k = LossKernel("ref", ref)
    >>> h, w = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    >>> y = torch.tensor([[1, 2, 3], [1, -100, -100]])
    >>> round(per_example_lm_loss(k, h, w, y).item(), 4)  # log(5) for both examples
    1.6094
    """
    from opake.dpsgd.bookkeeping import implicit_use

    transform = (head or LossOnlyHead()).kernel_kwargs()
    use = None if module is None else implicit_use(module)
    if use is not None:
        # the engine takes this layer's gradients from the recorded loss below: compute with
        # the detached parameters, so that autograd forms the hidden states' gradient only
        if "weight" in use.params:
            weight = weight.detach()
        if bias is not None and "bias" in use.params:
            bias = bias.detach()
    if weight.dtype != hidden.dtype:  # autocast: the projection runs in the compute dtype
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    common = {
        "bias": bias,
        "ignore_index": ignore_index,
        "chunk_size": kernel.chunk_size,
        **transform,
    }
    if use is None and (labels.dim() <= 1 or labels.shape[0] == 1):
        loss: torch.Tensor = kernel.impl(hidden, weight, labels, reduction="mean", **common)
        return loss.reshape(1) if per_example and labels.dim() > 1 else loss
    if use is not None and (hidden.dim() != 3 or labels.dim() != 2):
        raise OperationError(
            f"book-keeping: the loss-only head got hidden states {tuple(hidden.shape)} and "
            f"labels {tuple(labels.shape)}; it needs a batch: (B, T, H) and (B, T)"
        )
    if use is None:  # each example's mean in the kernel: its forward may form the gradients
        per_ex: torch.Tensor = kernel.impl(
            hidden, weight, labels, reduction="per_example", **common
        )
        means = per_ex.reshape(labels.shape[0]).float()
        return means if per_example else means.mean()
    recorded = _recorded_impl(kernel, hidden.device)
    per_token, record = recorded(hidden, weight, labels, **common)
    per_token = use.tap(per_token, functools.partial(_head_grads, record, tuple(use.params)))
    per_token = per_token.reshape(labels.shape[0], -1).float()
    counts = (labels != ignore_index).reshape(labels.shape[0], -1).sum(-1).clamp_min(1)
    losses: torch.Tensor = per_token.sum(-1) / counts
    return losses if per_example else losses.mean().to(per_token.dtype)


_log = logging.getLogger("opake.patches")
_reported: set[tuple[str, str]] = set()


def _recorded_impl(kernel: LossKernel, device: torch.device) -> Callable[..., Any]:
    """The ``linear_cross_entropy_recorded`` op: the loss backend's own when it declares one,
    else whatever :func:`~opake.core.plugins.select_kernel` chooses for the device (the
    ``OPAKE_KERNEL_BACKEND`` override, then the available backend of highest priority: a third
    party's as well as opake-kernels' ``chunked``). The fallback is logged once per loss backend
    and choice; a forced backend without the op raises
    :class:`~opake.core.errors.OperationError`, as for any op."""
    from opake.core.plugins import kernel_backends, select_kernel

    op = ops.LINEAR_CROSS_ENTROPY_RECORDED
    own = kernel_backends().get(kernel.backend)
    if own is not None and op in own.ops:
        return select_kernel(op, device, kernel.backend).impl
    try:
        choice = select_kernel(op, device)
    except OperationError as err:
        raise OperationError(
            f"the loss-only forward under the book-keeping engine needs {op!r}, which the loss "
            f"backend {kernel.backend!r} does not declare, and the selection found none: {err} "
            "Install opake-kernels (its chunked backend runs everywhere), or let the selection "
            "choose (unset OPAKE_KERNEL_BACKEND)."
        ) from err
    if (kernel.backend, choice.backend) not in _reported:
        _reported.add((kernel.backend, choice.backend))
        _log.info(
            "%s: loss backend %r has no such op; backend %r runs it (%s)",
            op,
            kernel.backend,
            choice.backend,
            choice.reason,
        )
    return choice.impl


def _head_grads(record: Any, attrs: tuple[str, ...], token_grads: torch.Tensor) -> dict[str, Any]:
    """What the book-keeping engine gets after the backward: the head's per-example gradients
    (``weight``: an implicit operator whose norms that backward computed; ``bias``: [B, V])."""
    grads = record.example_grads(token_grads.reshape(record.labels.shape))
    out: dict[str, Any] = {}
    if "weight" in attrs:
        out["weight"] = grads
    if "bias" in attrs:
        out["bias"] = grads.bias_grads()
    return out


_DROPPED = ("logits_to_keep", "return_dict")


def install_loss_only(model: Any, head: LossOnlyHead, kernel: LossKernel, patcher: Patcher) -> None:
    """Give this model instance the ``loss_only=True`` path (see the module docstring).

    Fails closed: the backbone and the head must exist with a ``weight``.
    """
    backbone = resolve_path(model, head.backbone)
    lm_head = resolve_path(model, head.lm_head)
    if backbone is None or not callable(backbone):
        raise ConfigurationError(
            f"{type(model).__name__} has no callable backbone at {head.backbone!r}; the family's "
            "LossOnlyHead does not match this model (transformers version?)."
        )
    if getattr(lm_head, "weight", None) is None:
        raise ConfigurationError(
            f"{type(model).__name__} has no output projection with a weight at "
            f"{head.lm_head!r}; the family's LossOnlyHead does not match this model."
        )
    inner = model.forward
    signature = inspect.signature(inner)
    try:
        backbone_takes_cache_flag = "use_cache" in inspect.signature(backbone.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic modules
        backbone_takes_cache_flag = False

    @functools.wraps(inner)
    def forward(
        *args: Any, loss_only: bool = False, per_example_loss: bool = False, **kwargs: Any
    ) -> object:
        if not loss_only:
            if per_example_loss:
                raise ConfigurationError(
                    "per_example_loss=True needs loss_only=True (it returns each example's "
                    "loss from the loss-only path); pass both, or neither"
                )
            return inner(*args, **kwargs)
        return _loss_only_forward(
            model,
            head,
            kernel,
            args,
            kwargs,
            signature=signature,
            cache_flag=backbone_takes_cache_flag,
            per_example=bool(per_example_loss),
        )

    tag(forward, "_opake_stage", "loss_only")
    patcher.set_attr(model, "forward", forward)


def _loss_only_forward(
    model: Any,
    head: LossOnlyHead,
    kernel: LossKernel,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    signature: inspect.Signature,
    cache_flag: bool,
    per_example: bool = False,
) -> CausalLMOutputWithPast | tuple[Any, ...]:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as err:
        raise InputTypeError(
            f"{type(model).__name__}(..., loss_only=True): {err}. Pass the model's usual "
            "arguments (input_ids, attention_mask, labels, ...)."
        ) from err
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is param.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    labels = arguments.pop("labels", None)
    shifted = arguments.pop("shift_labels", None)
    if labels is None and shifted is None:
        raise ConfigurationError(
            "loss_only=True needs labels: the loss-only path returns no logits, only the loss "
            "computed against labels. Pass labels=..., or drop loss_only to get logits."
        )
    if arguments.pop("num_items_in_batch", None) is not None:
        raise ConfigurationError(
            "loss_only=True computes each example's mean token loss; num_items_in_batch (a "
            "count over the whole batch) would mix examples before clipping. Drop it."
        )
    return_dict = arguments.get("return_dict", True)
    for name in _DROPPED:
        arguments.pop(name, None)
    if cache_flag:
        arguments["use_cache"] = False
    aux_scope = (
        contextlib.nullcontext(None) if head.aux_loss is None else head.aux_loss(model, arguments)
    )
    with aux_scope as aux:
        outputs = resolve_path(model, head.backbone)(**arguments)
    extra = aux() if aux is not None else None
    hidden = getattr(outputs, "last_hidden_state", None)
    if hidden is None:
        hidden = outputs[0]
    lm_head = resolve_path(model, head.lm_head)
    if shifted is not None:
        targets = shifted
    elif head.shift_labels:
        hidden = hidden[..., :-1, :]
        targets = labels[..., 1:]
    else:
        targets = labels
    targets = targets.to(hidden.device)
    loss = per_example_lm_loss(
        kernel,
        hidden,
        lm_head.weight,
        targets,
        bias=getattr(lm_head, "bias", None),
        head=head,
        per_example=per_example or extra is not None,
        module=lm_head,
    )
    if extra is not None:  # each example's own auxiliary term, then the mean if asked
        loss = loss.reshape(-1) + extra.reshape(-1).to(loss.dtype)
        if not per_example:
            loss = loss.mean()
    result = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return result if return_dict is not False else result.to_tuple()
