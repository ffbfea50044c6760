"""A batched per-example loss that both clipping engines can evaluate (see ``bookkeeping``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["BatchedLoss", "causal_lm_losses"]

#: what ``fn`` returns: ``[B]`` losses, or ``(losses, aux)`` with ``has_aux``
_Out_co = TypeVar("_Out_co", covariant=True)


class BatchedLoss(Generic[_Out_co]):
    """A loss that maps a *batch* to its vector of per-example losses ``[B]``.

    ``BatchedLoss(fn, model)``: ``fn(*args)`` takes the same positional arguments as a
    :func:`~opake.dpsgd.clipping.clipped_grad` loss, except that the arguments at
    ``batch_argnums`` keep their batch dimension, and returns ``[B]`` losses, entry ``i``
    depending on example ``i`` only (``(losses, aux)`` with ``has_aux``, ``aux`` batched too).
    ``model`` is the module ``fn`` runs (an ``nn.Module`` or the ``fmodel`` of
    :func:`~opake.functional.make_functional`); the book-keeping engine hooks its layers.

    Passed to ``clipped_grad`` as ``loss_fn``, it serves both engines: the book-keeping engine
    calls ``fn`` once per microbatch; the vmap engine (and every reference check) uses the
    one-example loss derived from it, ``fn`` on a batch of one (:meth:`per_example`), so the two
    engines differentiate the same function by construction.

    >>> import torch
    >>> lin = torch.nn.Linear(3, 1)
    >>> loss = BatchedLoss(lambda p, x: (torch.func.functional_call(lin, p, (x,)) ** 2)[:, 0], lin)
    >>> params = dict(lin.named_parameters())
    >>> loss(params, torch.ones(4, 3)).shape
    torch.Size([4])
    >>> one = loss.per_example(batch_argnums=(1,), has_aux=False)
    >>> one(params, torch.ones(3)).shape
    torch.Size([])
    """

    __slots__ = ("fn", "module")

    def __init__(self, fn: Callable[..., _Out_co], model: object) -> None:
        import torch

        if not callable(fn):
            raise InputTypeError(
                f"BatchedLoss(fn={fn!r}): expected a callable returning per-example losses [B]"
            )
        module = getattr(model, "module", model)
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(
                f"BatchedLoss(model=...): got a {type(model).__name__}; expected the "
                "torch.nn.Module that fn runs, or the fmodel of make_functional"
            )
        self.fn = fn
        self.module: torch.nn.Module = module

    def __call__(self, *args: Any) -> _Out_co:
        """Evaluate ``fn`` on a batch: ``[B]`` per-example losses (or ``(losses, aux)``)."""
        return self.fn(*args)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"BatchedLoss({name}, {type(self.module).__name__})"

    def per_example(
        self, *, batch_argnums: tuple[int, ...], has_aux: bool
    ) -> Callable[..., torch.Tensor | tuple[torch.Tensor, object]]:
        """The one-example loss: ``fn`` on a batch of one, entry 0 (what vmap differentiates)."""
        import torch
        from torch.utils._pytree import tree_map

        fn = self.fn

        def one(*args: Any) -> torch.Tensor | tuple[torch.Tensor, object]:
            call = [
                tree_map(lambda x: x[None] if isinstance(x, torch.Tensor) else x, a)
                if i in batch_argnums
                else a
                for i, a in enumerate(args)
            ]
            out = fn(*call)
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise ConfigurationError(
                        f"BatchedLoss fn returned a {type(out).__name__}; with has_aux=True it "
                        "must return a pair (losses [B], aux)"
                    )
                losses, aux = out
                return _single(losses), tree_map(
                    lambda x: x[0] if isinstance(x, torch.Tensor) else x, aux
                )
            return _single(out)

        one.__name__ = f"per_example({getattr(fn, '__name__', 'fn')})"
        return one


def _single(losses: object) -> torch.Tensor:
    import torch

    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (1,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)
        raise ConfigurationError(
            f"BatchedLoss fn returned {shape} for a batch of one; expected per-example losses "
            "of shape [B] (reduce over tokens per example, never over the batch)"
        )
    return losses[0]


def causal_lm_losses(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Per-example causal-LM losses ``[B]``: mean next-token cross-entropy over each example's
    own non-ignored labels (what a Hugging Face model returns as ``.loss`` for a batch of one;
    an example with no label gets 0). Computed in fp32.

    >>> import torch
    >>> logits = torch.zeros(2, 3, 5)
    >>> labels = torch.tensor([[0, 1, 2], [0, -100, -100]])
    >>> causal_lm_losses(logits, labels)
    tensor([1.6094, 0.0000])
    """
    import torch.nn.functional as F

    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ConfigurationError(
            f"causal_lm_losses: logits {tuple(logits.shape)} and labels {tuple(labels.shape)}; "
            "expected logits [B, T, V] and labels [B, T]"
        )
    batch, steps, vocab = logits.shape
    # labels shifted left with the last position ignored (as Hugging Face's loss does): the
    # logits stay one contiguous [B·T, V] block (no sliced copy, a row-wise log-softmax)
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    per_token = F.cross_entropy(
        logits.float().reshape(batch * steps, vocab),
        shift_labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).view(batch, steps)
    count = (shift_labels != ignore_index).sum(dim=1)
    return per_token.sum(dim=1) / count.clamp(min=1).to(per_token.dtype)
