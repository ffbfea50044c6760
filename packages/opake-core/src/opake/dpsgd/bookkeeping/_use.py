"""What a layer rule sees: the plan entry of a layer and one recorded use of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

    from opake.core.plugins import BookkeepingRule

__all__ = ["LayerRule", "LayerUse", "RuleExample", "first_input", "flat_batch"]


@dataclass(frozen=True)
class LayerRule:
    """How one module's trainable parameters get their per-example norms.

    ``rule`` is the name of the registered :class:`~opake.core.plugins.BookkeepingRule` that
    handles the module: built in, ``linear``, ``conv1d`` (GPT-2's transposed linear),
    ``embedding`` (index matching), ``layer_norm``, ``rms_norm`` (``torch.nn.RMSNorm``) —
    closed-form — or ``per_layer``: the per-example gradient of this layer alone, by ``vmap``
    over the layer (exact for any layer that treats examples independently; checked on every
    call); a plugin's rules add more (``opake.dpsgd.bookkeeping.registered_rules()``).
    ``params`` pairs the module attribute with the differentiated name it reads.
    """

    module: str
    rule: str
    params: tuple[tuple[str, str], ...]
    spec: BookkeepingRule | None = field(default=None, compare=False, repr=False)


@dataclass
class LayerUse:
    """One recorded call of a layer in the batched forward (what a rule's ``pieces`` reads).

    ``args``/``kwargs`` are the call's inputs, ``params`` the module's parameters as the call
    saw them (attribute → tensor), ``grad`` the gradient of the summed per-example losses with
    respect to the layer's output, ``output`` the detached output (only when the rule declares
    ``keeps_output``), ``batch`` the number of examples. :attr:`attrs` maps each
    differentiated attribute to the parameter name it reads.
    """

    layer: LayerRule
    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    params: dict[str, torch.Tensor]
    batch: int = 0
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    build: Callable[[torch.Tensor], Mapping[str, Any]] | None = None
    #: the pieces, when the rule built them in the backward (``grad``, ``args``, ``output``
    #: are then released); see ``eager`` in :class:`~opake.core.plugins.BookkeepingRule`
    built: list[tuple[str, Any]] | None = None
    grad_dtype: torch.dtype | None = None  # the output gradient's dtype (kept when released)
    #: the tapped output's shape and dtype (a hooked call; what a compiled recording probes)
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None

    @property
    def attrs(self) -> dict[str, str]:
        """Differentiated attribute → parameter name."""
        return dict(self.layer.params)

    def fail(self, why: str) -> OperationError:
        """An :class:`~opake.core.errors.OperationError` naming this layer (raise it)."""
        return OperationError(
            f"book-keeping: layer {self.layer.module!r} ({type(self.module).__name__}): {why}. "
            "Use clipped_grad(engine='vmap') for such layers"
        )


@dataclass(frozen=True)
class RuleExample:
    """A small module a rule handles, for the generated conformance test.

    The test feeds ``module`` a batch of ``steps`` tokens per example — token ids in
    ``[0, width)`` when ``tokens`` (id 0 is the padding of a padding-only example, so give an
    embedding ``padding_idx=0``), else ``[B, steps, width]`` vectors — and reduces its
    ``[B, steps, out]`` output with adversarial output gradients.

    >>> import torch
    >>> RuleExample(torch.nn.Linear(4, 3), width=4).steps
    5
    """

    module: Any
    width: int
    tokens: bool = False
    steps: int = 5


def flat_batch(x: torch.Tensor, batch: int, layer: str) -> torch.Tensor:
    """``[B, *, d]`` → ``[B, T, d]``; the batch must be dimension 0 (else OperationError).

    >>> import torch
    >>> flat_batch(torch.zeros(2, 3, 4, 5), 2, "proj").shape
    torch.Size([2, 12, 5])
    """
    if x.dim() < 2 or x.shape[0] != batch:
        raise OperationError(
            f"book-keeping: layer {layer!r} saw a tensor of shape {tuple(x.shape)}; expected the "
            f"batch ({batch}) on dimension 0 and features last. Use clipped_grad(engine='vmap') "
            "for models that fold or move the batch dimension"
        )
    return x.reshape(batch, -1, x.shape[-1])


def first_input(use: LayerUse) -> torch.Tensor:
    """The first positional input of the call (or the first keyword one): a tensor for the
    layers whose rules read it (a call's inputs are held untyped, as recorded)."""
    if use.args:
        first: torch.Tensor = use.args[0]
        return first
    if not use.kwargs:
        raise use.fail("it was called without inputs")
    keyword: torch.Tensor = next(iter(use.kwargs.values()))
    return keyword
