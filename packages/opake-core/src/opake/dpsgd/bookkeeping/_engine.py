"""The book-keeping clipping engine: per-example norms and the clipped sum from one backward.

One ordinary batched forward of a :class:`~opake.dpsgd.bookkeeping.BatchedLoss` runs with
forward hooks on every layer that uses a trainable parameter: the hook keeps the layer's input
and routes its output through an identity autograd node whose backward keeps the output
gradient. One ``backward`` of ``Σ_i loss_i`` (w.r.t. a scalar sink only, so autograd computes
activation gradients and no weight gradient at all) then leaves, per layer use, the pieces of
:mod:`opake.dpsgd.bookkeeping._rules`. Norms and the clipped sum come from those pieces.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.bookkeeping._certify import bounds, exact_add, exact_sq_norm, full_precision
from opake.dpsgd.bookkeeping._loss import BatchedLoss
from opake.dpsgd.bookkeeping._rules import (
    Dense,
    Implicit,
    ImplicitGrad,
    OuterSum,
    Piece,
    inner,
    sq_norm_abs,
    weighted_sum,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "BookkeepingInconclusiveError",
    "BookkeepingMismatchError",
    "BookkeepingPlan",
    "BookkeepingRunner",
    "ImplicitUse",
    "LayerRule",
    "bookkeeping_plan",
    "choose",
    "implicit_use",
    "prepare",
]

RULES = ("linear", "conv1d", "embedding", "layer_norm", "rms_norm", "per_layer")


@dataclass(frozen=True)
class LayerRule:
    """How one module's trainable parameters get their per-example norms.

    ``rule`` is one of ``linear``, ``conv1d`` (GPT-2's transposed linear), ``embedding``
    (index matching), ``layer_norm``, ``rms_norm`` (``torch.nn.RMSNorm``) — closed-form — or
    ``per_layer``: the per-example gradient of this layer alone, by ``vmap`` over the layer
    (exact for any layer that treats examples independently; checked on every call).
    ``params`` pairs the module attribute with the differentiated name it reads.
    """

    module: str
    rule: str
    params: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class BookkeepingPlan:
    """The rule of every layer that reads a differentiated parameter, and what has none.

    >>> import torch
    >>> plan = bookkeeping_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0.weight"])
    >>> [(layer.module, layer.rule) for layer in plan.layers], plan.supported
    ([('0', 'linear')], True)
    """

    layers: tuple[LayerRule, ...]
    unsupported: tuple[tuple[str, str], ...] = ()

    @property
    def supported(self) -> bool:
        """True when every differentiated parameter has a rule."""
        return not self.unsupported

    def explain(self) -> str:
        """One line per layer (module, rule, parameters), then what is unsupported and why."""
        lines = [
            f"{layer.module or '<root>'}: {layer.rule} ({', '.join(n for _, n in layer.params)})"
            for layer in self.layers
        ]
        lines += [f"UNSUPPORTED {what}: {why}" for what, why in self.unsupported]
        return "\n".join(lines)


def _is_conv1d(module: torch.nn.Module) -> bool:
    import torch

    cls = type(module)
    weight = getattr(module, "weight", None)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers")
        and hasattr(module, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def _plain(module: torch.nn.Module, base: type) -> bool:
    """``module`` is a ``base`` that runs ``base.forward`` (a subclass overriding ``forward``,
    e.g. a scaled embedding, computes something else: its closed-form rule would be wrong)."""
    return isinstance(module, base) and type(module).forward is base.forward  # type: ignore[attr-defined]


def _embed_scale(module: torch.nn.Module) -> torch.Tensor | float | None:
    """The factor of a Hugging Face ``*ScaledWordEmbedding`` (``embedding(ids) * embed_scale``)."""
    import torch

    if not (
        isinstance(module, torch.nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and type(module).__module__.startswith("transformers")
    ):
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    return scale if isinstance(scale, float) else None


def _rule_for(module: torch.nn.Module, attrs: set[str]) -> tuple[str | None, str]:
    import torch

    if _plain(module, torch.nn.Linear) and attrs <= {"weight", "bias"}:
        return "linear", ""
    if _is_conv1d(module) and attrs <= {"weight", "bias"}:
        return "conv1d", ""
    embedding = _plain(module, torch.nn.Embedding) or _embed_scale(module) is not None
    if embedding and attrs == {"weight"}:
        assert isinstance(module, torch.nn.Embedding)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return None, (
                "an nn.Embedding with max_norm, scale_grad_by_freq or sparse=True has no "
                "book-keeping rule"
            )
        return "embedding", ""
    if _plain(module, torch.nn.LayerNorm) and attrs <= {"weight", "bias"}:
        return "layer_norm", ""
    if _plain(module, torch.nn.RMSNorm) and attrs <= {"weight"}:
        return "rms_norm", ""
    nested = [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(False))]
    if nested:
        return None, (
            f"{type(module).__name__} owns trainable parameter(s) {sorted(attrs)} directly and "
            f"has parameterised submodules ({nested[:3]}); no rule, and the per-layer fallback "
            "needs a leaf layer"
        )
    return "per_layer", ""


def bookkeeping_plan(model: Any, names: Iterable[str]) -> BookkeepingPlan:
    """Which rule handles each layer reading one of the differentiated parameters ``names``.

    ``model`` is an ``nn.Module``, an ``fmodel`` or a :class:`BatchedLoss`; ``names`` are
    parameter names as in ``model.named_parameters()`` (a tied parameter under its first name;
    every module that reads it — e.g. GPT-2's ``wte`` and ``lm_head`` — becomes a use).
    """
    module = getattr(model, "module", model)
    wanted = list(names)
    canonical = {id(p): n for n, p in module.named_parameters()}
    wanted_set = set(wanted)
    unsupported: list[tuple[str, str]] = [
        (n, "not a parameter of the model (names must come from make_functional)")
        for n in wanted
        if n not in set(canonical.values())
    ]
    layers: list[LayerRule] = []
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if id(mod) in seen:
            continue
        params = tuple(
            (attr, canonical[id(p)])
            for attr, p in mod._parameters.items()
            if p is not None and canonical.get(id(p)) in wanted_set
        )
        if not params:
            continue
        seen.add(id(mod))
        rule, why = _rule_for(mod, {attr for attr, _ in params})
        if rule is None:
            unsupported.append((mod_name or "<root>", why))
        else:
            layers.append(LayerRule(mod_name, rule, params))
    return BookkeepingPlan(tuple(layers), tuple(unsupported))


@contextlib.contextmanager
def _holding(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
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
                mod._parameters[attr] = tensor  # type: ignore[assignment]
        yield
    finally:
        for mod, attr, old in reversed(saved):
            mod._parameters[attr] = old


class _Tap:
    """Identity autograd node that hands its output gradient to a record."""

    fn: Any = None

    @classmethod
    def apply(cls, x: torch.Tensor, sink: torch.Tensor, use: _Use) -> torch.Tensor:
        if cls.fn is None:
            import torch

            class Tap(torch.autograd.Function):
                @staticmethod
                def forward(x: torch.Tensor, sink: torch.Tensor, use: _Use) -> torch.Tensor:
                    return x.view_as(x)

                @staticmethod
                def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                    ctx.use = inputs[2]

                @staticmethod
                def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
                    use = ctx.use
                    use.grad = grad if use.grad is None else use.grad + grad
                    return grad, None, None

            cls.fn = Tap
        return cls.fn.apply(x, sink, use)  # type: ignore[no-any-return]


@dataclass
class _Use:
    layer: LayerRule
    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    params: dict[str, torch.Tensor]
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    build: Callable[[torch.Tensor], Mapping[str, Any]] | None = None


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

    __slots__ = ("_layer", "_module", "_runner", "params")

    def __init__(
        self,
        runner: BookkeepingRunner,
        layer: LayerRule,
        module: torch.nn.Module,
        params: dict[str, torch.Tensor],
    ) -> None:
        self._runner = runner
        self._layer = layer
        self._module = module
        self.params = params

    def tap(
        self, output: torch.Tensor, build: Callable[[torch.Tensor], Mapping[str, Any]]
    ) -> torch.Tensor:
        """Record this use; returns ``output`` (identity) through the engine's gradient tap.

        After the backward pass, ``build(grad_of_output)`` must return, for every attribute in
        :attr:`params`, either an :class:`~opake.dpsgd.bookkeeping.ImplicitGrad` (norms, weighted
        sums and inner products computed by an operator) or the per-example gradients
        ``[B, *parameter.shape]``. Compute ``output`` from *detached* parameters: the engine
        takes their gradients from ``build``, and the backward then skips the weight gradient.
        """
        runner = self._runner
        if runner._sink is None or _RECORDING.get() is not runner:
            raise OperationError(
                f"book-keeping: the implicit use of layer {self._layer.module!r} was tapped "
                "after its recording ended; tap it inside the batched forward"
            )
        use = _Use(self._layer, self._module, (), {}, dict(self.params), build=build)
        runner._uses.append(use)
        return _Tap.apply(output, runner._sink, use)


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
    if runner is None or not runner._recording:
        return None
    layer = runner._by_module.get(id(module))
    if layer is None:
        return None
    if not torch.is_grad_enabled() or runner._sink is None:
        raise OperationError(
            f"book-keeping: layer {layer.module!r} was used outside the recorded forward "
            "(under no_grad); use clipped_grad(method='vmap') for such models"
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
    return ImplicitUse(runner, layer, module, params)


def _flat(x: torch.Tensor, batch: int, layer: str) -> torch.Tensor:
    """``[B, *, d]`` → ``[B, T, d]``; the batch must be dimension 0."""
    if x.dim() < 2 or x.shape[0] != batch:
        raise OperationError(
            f"book-keeping: layer {layer!r} saw a tensor of shape {tuple(x.shape)}; expected the "
            f"batch ({batch}) on dimension 0 and features last. Use clipped_grad(method='vmap') "
            "for models that fold or move the batch dimension"
        )
    return x.reshape(batch, -1, x.shape[-1])


def _first_input(use: _Use) -> torch.Tensor:
    if use.args:
        return use.args[0]  # type: ignore[no-any-return]
    return next(iter(use.kwargs.values()))  # type: ignore[no-any-return]


@dataclass
class BookkeepingChunk:
    """What one microbatch leaves: losses, per-leaf squared norms and the pieces for the sum.

    ``leaf_sq`` are the computed squared norms (reported); ``clip_sq`` bound the squared norm
    of what each example adds to each leaf (clip with these, see :mod:`._bk_certify`);
    ``exact`` marks the (example, leaf) pairs that take the exact route.
    """

    loss: torch.Tensor
    leaf_sq: torch.Tensor  # [m, leaves] float64
    aux: Any
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    clip_sq: torch.Tensor | None = None  # [m, leaves] float64; None: leaf_sq
    exact: torch.Tensor | None = None  # [m, leaves] bool; None: no exact route

    def weighted(
        self,
        names: tuple[str, ...],
        leaf_factor: torch.Tensor,
        keep: torch.Tensor,
        like: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """``Σ_i leaf_factor[i, j] G_i`` for each leaf ``j`` (fp32, the leaf's shape)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        exact = self.exact
        routed: list[list[int]] = [[] for _ in names]
        if exact is not None:
            for i, j in (exact & keep[:, None]).nonzero().tolist():
                routed[j].append(i)
        everything = bool(keep.all())  # one host sync; skips the masking copies
        with full_precision():
            for j, name in enumerate(names):
                shape = like[name].shape
                total = torch.zeros(shape, dtype=torch.float32, device=leaf_factor.device)
                own = self.pieces.get(name, ())
                mask = None if everything and not routed[j] else keep
                if routed[j]:
                    assert exact is not None
                    mask = keep & ~exact[:, j]
                for piece in own:
                    total += weighted_sum(piece, leaf_factor[:, j], mask).reshape(shape)
                for i in routed[j]:
                    exact_add(own, i, leaf_factor[i, j], total)
                out[name] = total
        return out


class BookkeepingRunner:
    """Runs the book-keeping engine for one :class:`BatchedLoss` (used by ``clipped_grad``)."""

    def __init__(
        self, loss: BatchedLoss, *, argnums: int, batch_argnums: tuple[int, ...], has_aux: bool
    ) -> None:
        self.loss = loss
        self.argnums = argnums
        self.batch_argnums = batch_argnums
        self.has_aux = has_aux
        self._plans: dict[tuple[str, ...], BookkeepingPlan] = {}
        self._recording = False
        self._uses: list[_Use] = []
        self._sink: torch.Tensor | None = None
        self._batch = 0
        self._diff: Mapping[str, torch.Tensor] = {}
        self._by_module: dict[int, LayerRule] = {}
        self._half = False
        self._layout: tuple[str, ...] = ()  # the layers the last forward used, in order
        self._calls = 0
        self._verified: dict[tuple[Any, ...], int] = {}  # structure -> call of its last check
        self.verified = False
        self.disabled: str | None = None  # set when the check failed (auto falls back)

    def plan(self, names: tuple[str, ...]) -> BookkeepingPlan:
        """The (cached) plan for these differentiated names."""
        if names not in self._plans:
            self._plans[names] = bookkeeping_plan(self.loss.module, names)
        return self._plans[names]

    # ------------------------------------------------------------------ recording
    def _hook(self, layer: LayerRule) -> Callable[..., Any]:
        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            import torch

            if not self._recording:
                return None
            if not torch.is_grad_enabled() or self._sink is None:
                raise OperationError(
                    f"book-keeping: layer {layer.module!r} ran outside the recorded forward "
                    "(under no_grad, or recomputed by activation checkpointing in backward); "
                    "use clipped_grad(method='vmap') for such models"
                )
            params = {attr: getattr(module, attr) for attr in module._parameters}
            for attr, name in layer.params:
                if params[attr] is not self._diff[name]:
                    raise OperationError(
                        f"book-keeping: layer {layer.module!r} ran with a {attr!r} that is not "
                        f"the differentiated tensor {name!r}; the loss must run the model "
                        "through fmodel(params, ...) with the dict clipped_grad passes"
                    )
            if not isinstance(output, torch.Tensor):
                raise OperationError(
                    f"book-keeping: layer {layer.module!r} returned a {type(output).__name__}; "
                    "its rule needs a single tensor output. Use clipped_grad(method='vmap')"
                )
            if layer.rule != "per_layer" and self._batch > 1 and args:
                x = args[0]
                if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                    # a batch-broadcast input (e.g. position ids [1, T]): the output is shared by
                    # every example, so give each example its own view; the gradient reaching
                    # the tap is then per example instead of summed over the batch
                    args = (x.expand(self._batch, *x.shape[1:]), *args[1:])
                    output = output.expand(self._batch, *output.shape[1:])
            use = _Use(layer, module, args, kwargs, params)
            if layer.rule == "per_layer":
                use.output = output.detach()
            self._uses.append(use)
            return _Tap.apply(output, self._sink, use)

        return hook

    def _forward_backward(
        self, args: tuple[Any, ...], batch: int
    ) -> tuple[torch.Tensor, Any, list[_Use]]:
        import torch

        plan = self.plan(tuple(args[self.argnums]))
        module = self.loss.module
        by_name = dict(module.named_modules(remove_duplicate=False))
        handles = [
            by_name[layer.module].register_forward_hook(self._hook(layer), with_kwargs=True)
            for layer in plan.layers
        ]
        self._uses = []
        self._batch = batch
        self._diff = args[self.argnums]
        self._by_module = {id(by_name[layer.module]): layer for layer in plan.layers}
        self._sink = torch.zeros((), requires_grad=True)
        self._recording = True
        token = _RECORDING.set(self)
        try:
            with torch.enable_grad():
                out = self.loss.fn(*args)
                if self.has_aux:
                    if not (isinstance(out, tuple) and len(out) == 2):
                        raise ConfigurationError(
                            f"BatchedLoss fn returned a {type(out).__name__}; with has_aux=True "
                            "it must return a pair (losses [B], aux)"
                        )
                    losses, aux = out
                else:
                    losses, aux = out, None
                if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (batch,):
                    shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else losses
                    raise ConfigurationError(
                        f"BatchedLoss fn returned {shape} for a batch of {batch}; expected "
                        f"per-example losses of shape [{batch}] (reduce over each example's "
                        "tokens only: causal_lm_losses(logits, labels), or a patched model's "
                        "loss_only=True, per_example_loss=True)"
                    )
                self._recording = False
                if losses.requires_grad:
                    with _holding(module, self._diff):
                        torch.autograd.backward(losses.sum(), inputs=[self._sink])
        finally:
            _RECORDING.reset(token)
            self._recording = False
            self._sink = None
            self._by_module = {}
            for handle in handles:
                handle.remove()
        uses, self._uses = self._uses, []
        self._layout = tuple(use.layer.module for use in uses)
        self._diff = {}
        # half-precision activations (autocast, or a half model): the first-call check compares
        # with per-example autograd at half-precision tolerance
        self._half = any(
            use.grad is not None and use.grad.dtype in (torch.float16, torch.bfloat16)
            for use in uses
        )
        return losses.detach(), aux, uses

    # ------------------------------------------------------------------ pieces
    def _pieces(self, use: _Use, batch: int) -> list[tuple[str, Piece]]:
        import torch
        import torch.nn.functional as F

        layer, grad = use.layer, use.grad
        if grad is None:
            return []
        names = dict(layer.params)
        out: list[tuple[str, Piece]] = []
        if use.build is not None:
            return self._implicit(use, batch)
        if layer.rule == "per_layer":
            return self._per_layer(use, batch)
        x = _first_input(use)
        if layer.rule == "embedding":
            module = use.module
            if x.dim() < 1 or x.shape[0] != batch:
                _flat(x, batch, layer.module)  # raises
            ids = x.reshape(batch, -1)
            e = grad.reshape(batch, ids.shape[1], -1)
            pad = getattr(module, "padding_idx", None)
            if pad is not None:
                e = e * (ids != pad)[..., None].to(e.dtype)
            scale = _embed_scale(module)
            if scale is not None:  # output = embedding(ids) * scale (in the weight's dtype)
                weight = use.params["weight"]
                factor = torch.as_tensor(scale, device=e.device).to(weight.dtype)
                e = e.float() * factor.float()
            rows = int(getattr(module, "num_embeddings", 0))
            return [(names["weight"], OuterSum(ids, e, rows=rows))]
        g = _flat(grad, batch, layer.module)
        xf = _flat(x, batch, layer.module)
        if layer.rule == "linear":
            if "weight" in names:
                out.append((names["weight"], OuterSum(g, xf)))
        elif layer.rule == "conv1d":
            if "weight" in names:
                out.append((names["weight"], OuterSum(xf, g)))
        else:
            module = use.module
            shape = tuple(module.normalized_shape)  # type: ignore[arg-type]
            xn = x.float().reshape(batch, -1, *shape)
            if layer.rule == "layer_norm":
                h = F.layer_norm(xn, shape, eps=module.eps)  # type: ignore[arg-type]
            else:
                h = F.rms_norm(xn, shape, eps=module.eps)  # type: ignore[arg-type]
            gn = grad.float().reshape(batch, -1, *shape)
            if "weight" in names:
                out.append((names["weight"], Dense((gn * h).sum(dim=1))))
            if "bias" in names:
                out.append((names["bias"], Dense(gn.sum(dim=1))))
            return out
        if "bias" in names:
            out.append((names["bias"], Dense(g.float().sum(dim=1))))
        return out

    def _implicit(self, use: _Use, batch: int) -> list[tuple[str, Piece]]:
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

    def _per_layer(self, use: _Use, batch: int) -> list[tuple[str, Piece]]:
        """Per-example gradients of one leaf layer by ``vmap`` over that layer alone."""
        import torch
        from torch.func import functional_call, vjp, vmap
        from torch.utils._pytree import tree_leaves, tree_map

        layer = use.layer
        names = dict(layer.params)
        train = {attr: use.params[attr].detach() for attr in names}
        const = {k: v.detach() for k, v in use.params.items() if k not in names}

        def batched(x: Any) -> bool:
            return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch

        dims = (
            tree_map(lambda x: 0 if batched(x) else None, use.args),
            tree_map(lambda x: 0 if batched(x) else None, use.kwargs),
        )
        if 0 not in tree_leaves(dims):
            raise OperationError(
                f"book-keeping: layer {layer.module!r} got no input with the batch ({batch}) on "
                "dimension 0; use clipped_grad(method='vmap')"
            )

        def unsqueeze(tree: Any, tree_dims: Any) -> Any:
            return tree_map(
                lambda x, d: x[None] if d == 0 else x, tree, tree_dims, is_leaf=lambda x: x is None
            )

        def one(args: tuple[Any, ...], kwargs: dict[str, Any], g: torch.Tensor) -> Any:
            def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                out = functional_call(
                    use.module,
                    {**p, **const},
                    unsqueeze(args, dims[0]),
                    unsqueeze(kwargs, dims[1]),
                )
                return out[0]  # type: ignore[no-any-return]

            y, pullback = vjp(f, train)[:2]
            (grads,) = pullback(g)
            return y, grads

        assert use.output is not None
        assert use.grad is not None
        with torch.no_grad():
            y, grads = vmap(one, in_dims=(dims[0], dims[1], 0))(use.args, use.kwargs, use.grad)
        tol = 1e-5 if use.output.dtype in (torch.float32, torch.float64) else 1e-2
        # an example whose activations are not finite (e.g. a fully masked row in half
        # precision) must not poison the tolerance: it is dropped from the sum later anyway
        finite = use.output.float().abs().nan_to_num(0.0, posinf=0.0)
        scale = float(finite.max()) if finite.numel() else 0.0
        if y.shape != use.output.shape or not torch.allclose(
            y.float(), use.output.float(), rtol=tol, atol=tol * scale, equal_nan=True
        ):
            raise OperationError(
                f"book-keeping: layer {layer.module!r} ({type(use.module).__name__}) gives a "
                "different output on one example than in the batch: it mixes examples or does "
                "not take the batch on dimension 0, so no per-example rule applies; use "
                "clipped_grad(method='vmap')"
            )
        return [(names[attr], Dense(grads[attr])) for attr in names]

    # ------------------------------------------------------------------ the call
    def run(self, args: tuple[Any, ...], batch: int) -> BookkeepingChunk:
        """Forward + backward on one microbatch; norms per leaf and the pieces of the sum."""
        import torch

        diff = args[self.argnums]
        names = tuple(diff)
        losses, aux, uses = self._forward_backward(args, batch)
        pieces: dict[str, list[Piece]] = {}
        for use in uses:
            for name, piece in self._pieces(use, batch):
                pieces.setdefault(name, []).append(piece)
        device = losses.device
        columns, spans = [], []
        with full_precision():
            for name in names:
                own = pieces.get(name, [])
                if not own:
                    zeros = torch.zeros(batch, dtype=torch.float64, device=device)
                    columns.append(zeros)
                    spans.append(zeros)
                    continue
                total, span = sq_norm_abs(own[0])
                total = total.double()
                for k in range(1, len(own)):
                    sq, bound = sq_norm_abs(own[k])
                    total = total + sq.double()
                    span = span + bound
                    for j in range(k):
                        total = total + 2.0 * inner(own[j], own[k]).double()
                columns.append(total.clamp(min=0.0))
                spans.append(span)
        if not columns:
            empty = torch.zeros(batch, 0, dtype=torch.float64, device=device)
            return BookkeepingChunk(losses, empty, aux, pieces, empty, None)
        leaf_sq = torch.stack(columns, dim=1)
        clip_sq, exact = bounds(leaf_sq, torch.stack(spans, dim=1))
        if bool(exact.any()):  # strong cancellation: measure those examples exactly
            with full_precision():
                for i, j in exact.nonzero().tolist():
                    value = exact_sq_norm(pieces[names[j]], i, tuple(diff[names[j]].shape))
                    leaf_sq[i, j] = value
                    clip_sq[i, j] = value
        else:
            exact = None
        return BookkeepingChunk(losses, leaf_sq, aux, pieces, clip_sq, exact)

    def structure(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What a passed check covers: the differentiated names and dtypes, the batched
        arguments' shapes and dtypes (batch dimension excluded) and the recorded layer uses."""
        import torch
        from torch.utils._pytree import tree_leaves

        diff = args[self.argnums]
        batched = tuple(
            (tuple(x.shape[1:]), str(x.dtype))
            for pos in self.batch_argnums
            for x in tree_leaves(args[pos])
            if isinstance(x, torch.Tensor)
        )
        dtypes = tuple((name, str(value.dtype)) for name, value in diff.items())
        return dtypes, batched, self._layout

    def run_checked(
        self,
        args: tuple[Any, ...],
        batch: int,
        per_example: Callable[..., Any],
        *,
        check: bool,
    ) -> BookkeepingChunk:
        """:meth:`run`, then (when ``check`` and due) :meth:`verify` on an example with a
        non-zero gradient.

        Due: on every structure not yet verified (:meth:`structure`), and every
        ``RECHECK_EVERY`` calls. Raises :class:`BookkeepingMismatchError` (book-keeping is then
        off for good) or :class:`BookkeepingInconclusiveError` (no example could be compared:
        this call must not use the unchecked result).
        """
        chunk = self.run(args, batch)
        if not check or batch == 0:
            return chunk
        self._calls += 1
        key = self.structure(args)
        last = self._verified.get(key)
        if last is not None and self._calls - last < RECHECK_EVERY:
            return chunk
        import torch

        total = chunk.leaf_sq.sum(dim=1)
        usable = torch.where(torch.isfinite(total), total, 0.0)
        index = int(usable.argmax()) if usable.numel() else 0
        if not float(usable[index]) > 0.0:
            raise BookkeepingInconclusiveError(
                "book-keeping check inconclusive: no example of this batch has a finite, "
                "non-zero gradient to compare with per-example autograd"
            )
        mismatch = self.verify(per_example, args, chunk.leaf_sq, index)
        if mismatch == _INCONCLUSIVE:
            raise BookkeepingInconclusiveError(
                f"book-keeping check inconclusive: per-example autograd of example {index} "
                "is not finite"
            )
        if mismatch is not None:
            self.disabled = f"the check against per-example autograd failed ({mismatch})"
            raise BookkeepingMismatchError(
                f"book-keeping and per-example autograd disagree on {mismatch}: the loss "
                "mixes examples, the model moves the batch dimension, or a parameter is "
                "read outside a hooked layer. Use clipped_grad(method='vmap')"
            )
        self._verified[key] = self._calls
        self.verified = True
        return chunk

    def verify(
        self,
        per_example: Callable[..., Any],
        args: tuple[Any, ...],
        leaf_sq: torch.Tensor,
        index: int = 0,
    ) -> str | None:
        """Compare example ``index``'s per-leaf norms with plain autograd on it alone.

        Guards against what no rule can see: a loss that mixes examples, a model that moves
        the batch dimension, a parameter read outside its layer. Returns the mismatch, ``None``
        if every leaf agrees, or ``"inconclusive"`` when autograd's norm is not finite.
        """
        import torch
        from torch.utils._pytree import tree_map

        diff = args[self.argnums]
        leaves = {k: v.detach().requires_grad_(True) for k, v in diff.items()}
        call = [
            tree_map(lambda x: x[index] if isinstance(x, torch.Tensor) else x, a)
            if i in self.batch_argnums
            else a
            for i, a in enumerate(args)
        ]
        call[self.argnums] = leaves
        with torch.enable_grad():
            out = per_example(*call)
            loss = out[0] if self.has_aux else out
            with _holding(self.loss.module, leaves):
                got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        want = [0.0 if g is None else float(g.double().square().sum()) for g in got]
        have = [float(v) for v in leaf_sq[index].detach().double().cpu()]
        if not all(math.isfinite(v) for v in want + have):
            return _INCONCLUSIVE
        low = self._half or any(
            v.dtype not in (torch.float32, torch.float64) for v in diff.values()
        )
        tol = 5e-2 if low else 1e-4
        scale = math.sqrt(sum(want))
        for name, w, h in zip(diff, want, have, strict=True):
            if abs(math.sqrt(h) - math.sqrt(w)) > tol * max(scale, 1e-12):
                return (
                    f"example {index}, {name!r}: book-keeping norm {math.sqrt(h):.6g}, "
                    f"per-example autograd norm {math.sqrt(w):.6g}"
                )
        return None


class BookkeepingMismatchError(OperationError):
    """The check found book-keeping and per-example autograd disagree."""


class BookkeepingInconclusiveError(OperationError):
    """The check could not compare any example: the call falls back to the vmap engine."""


#: calls between two checks of an already verified structure
RECHECK_EVERY = 64
_INCONCLUSIVE = "inconclusive"


METHODS = ("auto", "vmap", "bookkeeping")


def prepare(
    loss_fn: Any, method: object, *, argnums: int, batch_argnums: tuple[int, ...], has_aux: bool
) -> tuple[Callable[..., Any], BookkeepingRunner | None]:
    """Validate ``clipped_grad(method=...)``; return the one-example loss and the runner."""
    if method not in METHODS:
        raise ConfigurationError(
            f"clipped_grad(method={method!r}): expected one of {METHODS} ('auto' uses "
            "book-keeping where it is exact, vmap otherwise)"
        )
    if not isinstance(loss_fn, BatchedLoss):
        if method == "bookkeeping":
            raise ConfigurationError(
                f"clipped_grad(method='bookkeeping') needs a BatchedLoss (per-example losses of "
                f"a whole batch, and the model it runs); got {loss_fn!r}. Wrap it: "
                "BatchedLoss(fn, fmodel) from opake.dpsgd.bookkeeping, or use method='vmap'"
            )
        return loss_fn, None
    per_example = loss_fn.per_example(batch_argnums=batch_argnums, has_aux=has_aux)
    if method == "vmap":
        return per_example, None
    runner = BookkeepingRunner(
        loss_fn, argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux
    )
    return per_example, runner


def choose(
    runner: BookkeepingRunner | None,
    method: str,
    names: tuple[str, ...],
    *,
    differentiable: bool,
    randomness: str,
    small: bool = False,
) -> tuple[BookkeepingRunner | None, str]:
    """Pick the engine for one call: ``(runner or None, reason)``; explicit requests are loud.

    ``small``: the differentiated parameters are a small part of the model (adapters next to a
    frozen model), where the vmap engine's expanded forward is the cheaper route: ``"auto"``
    then takes it (measured on LoRA: 1.00× vs 1.13× the non-private step).
    """
    if runner is None:
        return None, (
            "method='vmap'"
            if method == "vmap"
            else "loss_fn is a one-example loss (wrap a batched loss in BatchedLoss for "
            "book-keeping)"
        )
    if runner.disabled is not None:
        return None, runner.disabled
    why = None
    if differentiable:
        why = "an outer torch.func transform differentiates through grad_fn"
    elif method == "auto" and randomness != "error":
        why = f"randomness={randomness!r} (random layers): the per-example check cannot run"
    elif method == "auto" and small:
        why = (
            "the differentiated parameters are a small part of the model (e.g. LoRA): the "
            "vmap engine's expanded forward is cheaper there than book-keeping"
        )
    else:
        plan = runner.plan(names)
        if not plan.supported:
            why = "no book-keeping rule for: " + "; ".join(
                f"{what} ({reason})" for what, reason in plan.unsupported
            )
    if why is None:
        return runner, "book-keeping: every differentiated parameter has a rule"
    if method == "bookkeeping":
        raise ConfigurationError(f"clipped_grad(method='bookkeeping'): {why}")
    return None, why
