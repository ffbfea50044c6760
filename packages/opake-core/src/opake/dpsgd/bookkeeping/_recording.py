"""Recording a batched forward: the gradient tap, implicit uses, held parameters."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._pieces import Dense, Implicit, ImplicitGrad, OuterSum, Piece
from opake.dpsgd.bookkeeping._use import LayerRule, LayerUse
from opake.functional._autograd import cached_signature

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = [
    "ImplicitUse",
    "Tap",
    "holding",
    "implicit_pieces",
    "implicit_use",
    "rule_pieces",
]

_KINDS: dict[type, str] = {OuterSum: "outer", Dense: "dense", Implicit: "implicit"}


@contextlib.contextmanager
def holding(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Let ``module`` hold ``tensors`` (by parameter name, every tied alias too) during a backward.

    ``fmodel(params, ...)`` swaps the differentiated tensors in only for the forward call, but
    stock non-reentrant activation checkpointing recomputes a region in the *backward*, reading
    the module's own parameters: other tensors (``requires_grad`` differs, so it saves other
    tensors and fails; or other values, silently). Holding the differentiated tensors through
    the backward makes the recomputation see exactly what the forward saw. (Only the backward:
    a loss that runs the module's own weights in the forward must still fail loudly.)
    """
    where: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for _, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((mod, attr))
    own = dict(module.named_parameters())
    saved: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        for name, tensor in tensors.items():
            param = own.get(name)
            if param is None or param is tensor:
                continue
            for mod, attr in where.get(id(param), ()):
                saved.append((mod, attr, mod._parameters[attr]))
                # a plain tensor in a Parameter's slot for one backward (torch declares the
                # slots Parameter-only; functional_call swaps tensors in the same way)
                slots = cast("dict[str, torch.Tensor | None]", mod._parameters)
                slots[attr] = tensor
        yield
    finally:
        for mod, attr, old in reversed(saved):
            mod._parameters[attr] = old


class _TapFunction(Protocol):
    """The ``autograd.Function`` class below, as called here (torch leaves ``apply`` untyped)."""

    def apply(self, x: torch.Tensor, sink: torch.Tensor, use: LayerUse) -> torch.Tensor: ...


class Tap:
    """Identity autograd node that hands its output gradient to a record."""

    fn: _TapFunction | None = None

    @classmethod
    def apply(cls, x: torch.Tensor, sink: torch.Tensor, use: LayerUse) -> torch.Tensor:
        if cls.fn is None:
            import torch

            @cached_signature
            class Tap(torch.autograd.Function):
                @staticmethod
                def forward(x: torch.Tensor, sink: torch.Tensor, use: LayerUse) -> torch.Tensor:
                    return x.view_as(x)

                @staticmethod
                def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                    ctx.use = inputs[2]

                @staticmethod
                def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
                    _receive(ctx.use, grad)
                    return grad, None, None

            cls.fn = Tap
        return cls.fn.apply(x, sink, use)


def _receive(use: LayerUse, grad: torch.Tensor) -> None:
    """A use's output gradient arrives (the tap's backward); a rule that declares ``eager``
    (:class:`~opake.core.plugins.BookkeepingRule`) builds its pieces now and the use lets go of
    its recorded tensors (for a norm: two activation-sized tensors, released here instead of
    being held until every layer's gradient is known)."""
    if use.built is not None:
        raise use.fail("a second output gradient reached a use whose pieces were built")
    use.grad = grad if use.grad is None else use.grad + grad
    use.grad_dtype = grad.dtype
    spec = use.layer.spec
    if use.build is None and spec is not None and spec.eager:
        use.built = rule_pieces(use)
        use.grad, use.output, use.args, use.kwargs = None, None, (), {}


def rule_pieces(use: LayerUse) -> list[tuple[str, Piece]]:
    """The pieces of a use its layer's rule builds, checked against what the rule declares."""
    spec = use.layer.spec
    assert spec is not None
    got = spec.load_pieces()(use)
    names = use.attrs
    if not isinstance(got, Mapping) or set(got) != set(names):
        keys = sorted(got) if isinstance(got, Mapping) else type(got).__name__
        raise use.fail(
            f"its rule {spec.name!r} produced pieces for {keys}; expected exactly {sorted(names)}"
        )
    out: list[tuple[str, Piece]] = []
    for attr, piece in got.items():
        kind = _KINDS.get(type(piece))
        if kind is None or kind != spec.kind_of(attr):
            raise use.fail(
                f"its rule {spec.name!r} produced a {type(piece).__name__} for {attr!r}; it "
                f"declares a {spec.kind_of(attr)!r} piece"
            )
        out.append((names[attr], piece))
    return out


#: the runner whose batched forward is being recorded (what :func:`implicit_use` reports to)
_RECORDING: contextvars.ContextVar[BookkeepingRunner | None] = contextvars.ContextVar(
    "opake_bookkeeping_recording", default=None
)


class ImplicitUse:
    """A recorded use of a layer's parameters that the layer's forward hook does not see.

    Returned by :func:`implicit_use`. ``params`` maps the layer's attributes (``"weight"``,
    ``"bias"``) to the differentiated tensors to compute with; :meth:`tap` routes the use's
    output through the engine, and ``build`` later turns the output gradient into each
    attribute's per-example gradients.
    """

    __slots__ = ("_layer", "_module", "_replay", "_runner", "params")

    def __init__(
        self,
        runner: BookkeepingRunner,
        layer: LayerRule,
        module: torch.nn.Module,
        params: dict[str, torch.Tensor],
        replay: bool = False,
    ) -> None:
        self._runner = runner
        self._layer = layer
        self._module = module
        self.params = params
        self._replay = replay  # activation checkpointing recomputes the recorded forward

    def tap(
        self,
        output: torch.Tensor,
        build: Callable[[torch.Tensor], Mapping[str, Any]],
        *,
        inside: bool = False,
    ) -> torch.Tensor:
        """Record this use; returns ``output`` (identity) through the engine's gradient tap.

        After the backward pass, ``build(grad_of_output)`` must return, for every attribute in
        :attr:`params`, either an :class:`~opake.dpsgd.bookkeeping.ImplicitGrad` (norms, weighted
        sums and inner products computed by an operator) or the per-example gradients
        ``[B, *parameter.shape]``. Compute ``output`` from *detached* parameters: the engine
        takes their gradients from ``build``, and the backward then skips the weight gradient.
        ``inside=True``: tapped by the layer's own forward (a layer whose output the engine's
        hook cannot read, e.g. a tuple): this use replaces the hook's record of the call.
        """
        runner = self._runner
        if self._replay:  # the same computation, recorded once already
            return output
        if runner._sink is None or _RECORDING.get() is not runner:
            raise OperationError(
                f"book-keeping: the implicit use of layer {self._layer.module!r} was tapped "
                "after its recording ended; tap it inside the batched forward"
            )
        use = LayerUse(
            self._layer, self._module, (), {}, dict(self.params), runner._batch, build=build
        )
        runner._uses.append(use)
        if inside:
            runner._inside.add(id(self._module))
        return Tap.apply(output, runner._sink, use)


def implicit_use(module: torch.nn.Module) -> ImplicitUse | None:
    """The book-keeping engine's view of a use of ``module``'s parameters outside its forward.

    Code that reads a layer's parameters without calling the layer (e.g. a loss-only forward
    that hands ``lm_head.weight`` to a linear cross-entropy kernel) asks this first: ``None``
    unless a book-keeping forward is being recorded and ``module`` holds differentiated
    parameters; otherwise an :class:`ImplicitUse` to compute with and tap.

    >>> import torch
    >>> implicit_use(torch.nn.Linear(2, 2)) is None  # nothing is being recorded
    True
    """
    import torch

    runner = _RECORDING.get()
    # in the recorded backward (runner still current, its sink alive), activation
    # checkpointing recomputes the forward: replay the recorded computation, recording nothing
    replay = runner is not None and not runner._recording and runner._sink is not None
    if runner is None or not (runner._recording or replay):
        return None
    layer = runner._by_module.get(id(module))
    if layer is None:
        return None
    if not torch.is_grad_enabled() or runner._sink is None:
        raise OperationError(
            f"book-keeping: layer {layer.module!r} was used outside the recorded forward "
            "(under no_grad); use clipped_grad(engine='vmap') for such models"
        )
    params: dict[str, torch.Tensor] = {}
    for attr, name in layer.params:
        tensor = getattr(module, attr)
        if tensor is not runner._diff[name]:
            raise OperationError(
                f"book-keeping: layer {layer.module!r} holds a {attr!r} that is not the "
                f"differentiated tensor {name!r}; the loss must run the model through "
                "fmodel(params, ...) with the dict clipped_grad passes"
            )
        params[attr] = tensor
    return ImplicitUse(runner, layer, module, params, replay)


def implicit_pieces(use: LayerUse, batch: int) -> list[tuple[str, Piece]]:
    """The pieces an :class:`ImplicitUse`'s ``build`` returns, checked."""
    import torch

    layer = use.layer
    assert use.build is not None
    assert use.grad is not None
    got = use.build(use.grad)
    names = dict(layer.params)
    if not isinstance(got, Mapping) or set(got) != set(names):
        keys = sorted(got) if isinstance(got, Mapping) else type(got).__name__
        raise OperationError(
            f"book-keeping: the implicit use of layer {layer.module!r} built {keys}; "
            f"expected per-example gradients for exactly {sorted(names)}"
        )
    out: list[tuple[str, Piece]] = []
    for attr, value in got.items():
        shape = tuple(use.params[attr].shape)
        if isinstance(value, ImplicitGrad):
            if value.batch != batch or tuple(value.shape) != shape:
                raise OperationError(
                    f"book-keeping: layer {layer.module!r}: implicit gradients of "
                    f"{value.batch} examples of shape {tuple(value.shape)}; expected "
                    f"{batch} of shape {shape}"
                )
            out.append((names[attr], Implicit(value)))
        elif isinstance(value, torch.Tensor) and tuple(value.shape) == (batch, *shape):
            out.append((names[attr], Dense(value)))
        else:
            what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise OperationError(
                f"book-keeping: layer {layer.module!r}: {attr!r} got {what}; expected an "
                f"ImplicitGrad or per-example gradients of shape {(batch, *shape)}"
            )
    return out
