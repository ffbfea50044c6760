"""The book-keeping recording compiled (``DPTraining(compile=True)`` with a ``BatchedLoss``).

The eager recording (:meth:`~._runner.BookkeepingRunner._forward_backward`) registers forward
hooks per call and taps each layer's output with an autograd node whose backward hands the
output gradient to a Python record: neither traces into one graph. Here the hooks are
registered once per plan and stay; a hook keeps the call's inputs and adds a *probe* — a zero
tensor of the output's shape, an input of the compiled graph — to the layer's output, so the
gradient of ``Σ_i loss_i`` with respect to the probe *is* the output gradient the eager tap
receives. The batched forward (hooks included) is compiled by ``torch.compile`` with
``fullgraph=True`` (Inductor compiles its backward through AOTAutograd); the differentiated
tensors enter it detached, so the backward computes activation gradients only, as eager.

A structure's first call records eagerly: it learns the uses' layout (layer, output shape and
dtype: the probes of the compiled calls) and runs every check of the eager recording. A model
whose parameters the eager recording sees outside its layers' hooks (an implicit use, e.g. a
loss-only head) records eagerly for good (logged). The uses built from a compiled call hold
the same tensors an eager call's do; norms, certified bounds, the exact route, the clipped sum
and the check against per-example autograd are the eager code, unchanged: the clipping proof
does not depend on compilation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._recording import _receive
from opake.dpsgd.bookkeeping._use import LayerRule, LayerUse

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner

__all__ = ["CompiledRecording"]

_LOG = logging.getLogger("opake.core")

#: one use of a layout: the plan layer's index, the tapped output's shape and dtype
Slot = tuple[int, tuple[int, ...], "torch.dtype"]
#: what a compiled hook keeps of one call: the layer's index, its module, inputs, parameters,
#: (a rule that keeps it) its detached output, and the output's shape
Record = tuple[
    int, "torch.nn.Module", tuple[Any, ...], dict[str, Any], dict[str, Any], Any, tuple[int, ...]
]


class CompiledRecording:
    """The compiled batched forward and backward of one :class:`BookkeepingRunner`."""

    def __init__(self, runner: BookkeepingRunner) -> None:
        self._runner = runner
        self._names: tuple[str, ...] | None = None  # the plan the hooks serve
        self._layers: tuple[LayerRule, ...] = ()
        self._handles: list[Any] = []
        self._layouts: dict[tuple[Any, ...], tuple[Slot, ...] | None] = {}
        self._probed: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}  # reused probes
        self._compiled: Callable[..., Any] | None = None
        # the state of the call being traced or run (read by the hooks)
        self._active = False
        self._batch = 0
        self._probes: tuple[torch.Tensor, ...] = ()
        self._records: list[Record] = []
        #: why this runner records eagerly for good (None: it compiles)
        self.eager: str | None = None
        #: the calls recorded by the compiled forward and backward
        self.calls = 0
        #: whether the last call compiled a new graph (its check is due whatever its structure)
        self.fresh = False

    # ------------------------------------------------------------------ hooks
    def _hook(self, index: int, layer: LayerRule, owner: torch.nn.Module) -> Callable[..., Any]:
        import torch

        spec = layer.spec
        assert spec is not None

        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            if not self._active or module is not owner:  # a deep copy carries the hook along
                return None
            if spec.broadcast and self._batch > 1 and args:
                x = args[0]
                # as the eager hook: a batch-broadcast input gets one view per example
                if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                    args = (x.expand(self._batch, *x.shape[1:]), *args[1:])
                    output = output.expand(self._batch, *output.shape[1:])
            params = {attr: getattr(module, attr) for attr in module._parameters}
            kept = output.detach() if spec.keeps_output else None
            shape = tuple(output.shape)
            k = len(self._records)
            self._records.append((index, module, args, kwargs, params, kept, shape))
            if k >= len(self._probes) or tuple(self._probes[k].shape) != shape:
                return None  # not the eager layout: _check refuses the call
            return output + self._probes[k]

        return hook

    def _install(self, names: tuple[str, ...]) -> None:
        """Hooks for the plan of ``names`` (once; a new plan replaces them)."""
        if self._names == names:
            return
        self.release()
        module = self._runner.loss.module
        by_name = dict(module.named_modules(remove_duplicate=False))
        self._layers = tuple(self._runner.plan(names).layers)
        self._handles = [
            by_name[layer.module].register_forward_hook(
                self._hook(i, layer, by_name[layer.module]), with_kwargs=True
            )
            for i, layer in enumerate(self._layers)
        ]
        self._names = names
        self._compiled = None  # a graph traced with other hooks

    def release(self) -> None:
        """Remove the hooks (the runner is done with the model)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._names, self._layers = [], None, ()

    # ------------------------------------------------------------------ forward
    def _forward(self, probes: tuple[torch.Tensor, ...], *args: Any) -> tuple[Any, list[Record]]:
        """The batched loss with every hooked layer's output probed (what is compiled)."""
        records: list[Record] = []
        self._records = records
        self._probes = probes
        self._active = True
        try:
            out = self._runner.loss.fn(*args)
        finally:
            self._active = False
            self._probes = ()
            self._records = []
        return out, records

    def _layout(self, uses: list[LayerUse]) -> tuple[Slot, ...] | None:
        """The layout an eager recording shows, or ``None`` when it cannot be compiled."""
        index = {layer.module: i for i, layer in enumerate(self._layers)}
        slots: list[Slot] = []
        for use in uses:
            if use.build is not None or use.shape is None or use.layer.module not in index:
                self.eager = (
                    f"layer {use.layer.module!r} is used outside its forward hook (an implicit "
                    "use, e.g. a loss-only head), which only the eager recording sees"
                )
                _LOG.warning("compile=True: book-keeping records eagerly: %s", self.eager)
                return None
            assert use.dtype is not None
            slots.append((index[use.layer.module], use.shape, use.dtype))
        return tuple(slots)

    def forward_backward(
        self, args: tuple[Any, ...], batch: int
    ) -> tuple[torch.Tensor, Any, list[LayerUse]]:
        """The runner's recording: eager on a structure's first call, compiled after."""
        import torch

        runner = self._runner
        self.fresh = False
        diff = args[runner.argnums]
        key = (*runner.shapes(args), batch)  # the names among the shapes
        if self.eager is not None or key not in self._layouts:
            losses, aux, uses = runner._forward_backward(args, batch)
            if self.eager is None:
                self._install(tuple(diff))
                self._layouts[key] = self._layout(uses)
            return losses, aux, uses
        layout = self._layouts[key]
        if layout is None:
            return runner._forward_backward(args, batch)
        device = next(iter(diff.values())).device
        probes = self._probed.get((key, device))
        if probes is None:  # zeros that no call writes to (autograd.grad accumulates nothing)
            probes = tuple(
                torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
                for _, shape, dtype in layout
            )
            self._probed = {(key, device): probes}  # the last shape's only
        call = list(args)
        call[runner.argnums] = detached = {name: t.detach() for name, t in diff.items()}
        if self._compiled is None:
            self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False)
        self._batch = batch
        grads: tuple[torch.Tensor | None, ...] = (None,) * len(probes)
        with torch.enable_grad():
            graphs = _graphs()
            try:
                out, records = self._compiled(probes, *call)
                self.fresh = _graphs() != graphs
            except _dynamo_errors() as err:  # the model does not trace: eager from now on
                first = next((line for line in str(err).splitlines() if line.strip()), "")
                self.eager = (
                    f"torch.compile failed on the batched forward ({type(err).__name__}: "
                    f"{first.strip()[:200]})"
                )
                _LOG.warning("compile=True: book-keeping records eagerly: %s", self.eager)
                return runner._forward_backward(args, batch)
            losses, aux = runner._split(out, batch)
            self._check(records, layout, detached)
            if losses.requires_grad:
                grads = torch.autograd.grad(losses.sum(), probes, allow_unused=True)
        uses = []
        for (index, module, inputs, kwargs, params, kept, _), grad in zip(
            records, grads, strict=True
        ):
            use = LayerUse(self._layers[index], module, inputs, kwargs, params, batch, kept)
            if grad is not None:
                _receive(use, grad)
            uses.append(use)
        runner._note(uses)
        self.calls += 1
        return losses.detach(), aux, uses

    def _check(
        self,
        records: list[Record],
        layout: tuple[Slot, ...],
        diff: dict[str, torch.Tensor],
    ) -> None:
        """The compiled call used the layers of the eager layout, each with the
        differentiated tensors (else :class:`OperationError`: the engine falls back)."""
        used = tuple((record[0], record[6]) for record in records)
        if used != tuple((index, shape) for index, shape, _ in layout):
            raise OperationError(
                "book-keeping (compiled): the batched forward used other layers than its eager "
                "recording of the same shapes (data-dependent control flow); use "
                "compile=False or engine='vmap'"
            )
        for index, _, _, _, params, _, _ in records:
            layer = self._layers[index]
            for attr, name in layer.params:
                if params.get(attr) is not diff[name]:
                    raise OperationError(
                        f"book-keeping (compiled): layer {layer.module!r} ran with a {attr!r} "
                        f"that is not the differentiated tensor {name!r}; the loss must run "
                        "the model through fmodel(params, ...) with the dict clipped_grad passes"
                    )


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    """The failures of ``torch.compile`` itself (a user's error raised while tracing is
    re-raised by Dynamo as it is, and raised again by the eager recording)."""
    import torch._dynamo.exc as dynamo

    return (dynamo.TorchDynamoException,)


def _graphs() -> int:
    """How many graphs Dynamo has compiled in this process (a call that changes it traced a
    new one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
