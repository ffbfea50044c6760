"""DP-SGD over FSDP2-sharded parameters: sharded at rest, gathered for the per-example step.

Implementation of :class:`opake.dpsgd.distributed.ShardedDPOptimizer`,
:func:`~opake.dpsgd.distributed.compute_template` and
:func:`~opake.dpsgd.distributed.gather_full_params`. See ``docs/design/fsdp2.md``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a ``DTensor`` whose rows
are split over the ranks, and so are the optimizer states built over them. Its forward hooks
swap in gathered parameters one module at a time — which silently overrides the parameters a
``torch.func.functional_call`` passes in, so per-example gradients must *not* be computed
through the sharded module. Here each step instead

1. gathers the full parameters (``DTensor.full_tensor``) and runs ``clipped_grad`` on a
   parameter-free copy of the architecture (:func:`compute_template`) — per-example
   gradients of full parameters, as in the unsharded case;
2. reduce-scatters the fp32 clipped sums (a ``Partial`` ``DTensor`` redistributed to the
   parameter's own placements): each rank receives *its rows* of the global sum;
3. adds to each rank's rows the matching rows of one full-size Gaussian draw — the same draw
   on every rank (shared seed), or rank 0's broadcast — so every coordinate of the global sum
   gets independent noise exactly once (the draw equals the unsharded run's). With a shared
   key each rank generates only its own rows of it, parameter by parameter;
4. divides by q·N and lets the wrapped optimizer update the shards (sharded optimizer state).

Level 2 (:mod:`opake.dpsgd.distributed.sharded`) replaces step 1: its ``grad_fn`` runs the
sharded module itself (FSDP gathers one unit at a time) and feeds steps 2-4 here; with
``reduce_scatter=True`` (a step of one physical batch) it does step 2 itself, one parameter at a
time as each sum is formed. Each step starts by lining the ranks up (one small all-gather,
:func:`~._agree.line_up`, the collective every level-2 ``grad_fn`` call starts with too): a
rank that steps while another runs one more ``grad_fn`` call makes both raise, not hang. The
reductions and the noise rows are :mod:`._rows`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, overload

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.distributed._optim import DistributedDPOptimizer, _BroadcastNoise
from opake.dpsgd.distributed._rows import (
    ScatteredGrads,
    _is_sharded,
    _local,
    _ShardedNoise,
    reduce_rows,
)
from opake.dpsgd.optimizer._dp_optimizer import DPOptimizer, StepReport

if TYPE_CHECKING:
    from typing import Literal

    import torch

    from opake.dpsgd.clipping import ClipState

__all__ = ["ShardedDPOptimizer", "compute_template", "gather_full_params"]


def compute_template(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters live on the ``meta`` device (no memory).

    Call it **before** ``fully_shard(model)``. ``make_functional(template)`` then gives the
    ``fmodel`` that :func:`gather_full_params`'s tensors are fed to: the template has no FSDP
    hooks (which would override ``functional_call``'s parameters) and holds no parameter data;
    buffers are copied (they are not sharded and the forward reads them). Tied parameters stay
    tied.

    Example:
        >>> import torch
        >>> from opake.dpsgd.distributed import compute_template
        >>> template = compute_template(torch.nn.Linear(2, 3))
        >>> template.weight.device.type, template.weight.shape
        ('meta', torch.Size([3, 2]))
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(
            f"model={type(model).__name__}: expected the nn.Module, before fully_shard"
        )
    if any(_is_sharded(p) for p in model.parameters()):
        raise ConfigurationError(
            "compute_template(model) got an already sharded model (DTensor parameters): call it "
            "before fully_shard(model)"
        )
    memo: dict[int, Any] = {}
    for param in model.parameters():
        if id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    return copy.deepcopy(model, memo)


@overload
def gather_full_params(
    model: torch.nn.Module, *, partition_trainable: Literal[False] = False
) -> dict[str, torch.Tensor]: ...


@overload
def gather_full_params(
    model: torch.nn.Module, *, partition_trainable: Literal[True]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


def gather_full_params(
    model: torch.nn.Module, *, partition_trainable: bool = False
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every parameter of a (sharded) module as a full, detached, plain tensor.

    ``DTensor`` parameters are all-gathered (a collective: every rank calls this, in the same
    order); plain ones are returned detached. With ``partition_trainable=True`` returns
    ``(trainable, frozen)`` like ``make_functional``. Names are the module's parameter names,
    so the dicts feed ``make_functional(compute_template(model))``.

    Example:
        >>> import torch
        >>> from opake.dpsgd.distributed import gather_full_params
        >>> sorted(gather_full_params(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model={type(model).__name__}: expected an nn.Module")
    trainable: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if _is_sharded(param) else param
        (trainable if param.requires_grad else frozen)[name] = full.detach()
    if partition_trainable:
        return trainable, frozen
    return {**trainable, **frozen}


class ShardedDPOptimizer(DistributedDPOptimizer):
    """DP-SGD for an FSDP2-sharded module: sharded parameters and optimizer state.

    Build it over the ``fully_shard``-ed module and an optimizer over its (``DTensor``)
    parameters. Each step: every rank computes the full-size clipped sums of its shard of the
    global Poisson batch — level 1: :func:`gather_full_params` (full parameters, transient) and
    ``clipped_grad`` with ``make_functional(compute_template(model))``; level 2:
    :func:`~opake.dpsgd.distributed.sharded_clipped_grad` on the sharded module itself — and
    :meth:`accumulate`-s them;
    :meth:`step` checks that every rank took part and clipped to the same bound,
    reduce-scatters the sums (fp32) so each rank holds its rows of the global sum, adds its rows
    of one full-size Gaussian draw (identical on every rank: the noise of every coordinate is
    drawn once), divides by the global ``q·N``, and steps the optimizer on the shards. The
    accountant records the global sample rate, as with :class:`DistributedDPOptimizer`.

    Memory: parameters and optimizer state are sharded at rest; with :func:`gather_full_params`
    each rank holds, during a step, the gathered parameters, one microbatch of per-example
    gradients and the full-size fp32 sums (each released once reduce-scattered); the noise is
    drawn as this rank's rows only (shared key), or one parameter's full size at a time.
    For per-layer sharded compute (FSDP gathers one unit at a time; the book-keeping engine),
    feed it the sums of :func:`~opake.dpsgd.distributed.sharded_clipped_grad` instead: see
    ``docs/design/fsdp2.md`` (level 2). A step of one physical batch can take the
    :class:`~._rows.ScatteredGrads` of its ``grad_fn(..., reduce_scatter=True)``: this rank's
    rows, reduced as each sum was formed, so no rank holds the full-size sums of the step.
    Parameters that are not ``DTensor`` are all-reduced like in
    :class:`DistributedDPOptimizer`. Checkpoints of the sharded state are not supported by
    :func:`save_checkpoint_distributed`; the replica fingerprint check is off (shards differ
    by design).

    Args:
        optimizer: a ``torch.optim`` optimizer over the sharded module's parameters.
        module: the ``fully_shard``-ed module (every rank sharded it the same way).
        **options: :class:`DistributedDPOptimizer` keyword arguments (``noise_sync``, noise,
            sampler, accountant, ...); ``broadcast_parameters`` and ``check_sync_every`` do
            not apply.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, **options: Any
    ) -> None:
        import torch

        for name in ("broadcast_parameters", "check_sync_every", "process_group"):
            if name in options:
                raise ConfigurationError(
                    f"ShardedDPOptimizer({name}=...): not applicable — the sharded parameters "
                    "come from fully_shard (which sets the process group) and differ per rank"
                )
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(
                f"module={type(module).__name__}: expected the fully_shard-ed nn.Module"
            )
        sharded = [p for p in module.parameters() if _is_sharded(p)]
        if not sharded:
            raise ConfigurationError(
                "ShardedDPOptimizer: the module has no DTensor parameters (it was not "
                "fully_shard-ed); use DistributedDPOptimizer for replicated parameters"
            )
        mesh = sharded[0].device_mesh
        # equal meshes, not one object: DTensor caches its specs, so parameters sharded over
        # one mesh can report an equal mesh object of an earlier fully_shard call
        others = [p.device_mesh for p in sharded if p.device_mesh != mesh]
        if others or mesh.ndim != 1:
            raise ConfigurationError(
                "ShardedDPOptimizer supports one 1-D device mesh (data-parallel sharding); got "
                f"meshes {mesh}{''.join(f', {m}' for m in others[:1])}"
            )
        group = mesh.get_group()
        super().__init__(
            optimizer,
            module,
            process_group=group,
            broadcast_parameters=False,
            check_sync_every=0,
            **options,
        )
        inner = self.noise.inner if isinstance(self.noise, _BroadcastNoise) else self.noise
        self.noise = _ShardedNoise(
            inner, broadcast=self.noise_sync == "broadcast", group=group, device=self._comm
        )
        self._full: dict[str, torch.Tensor] = {}
        self._full_sensitivity: float | None = None
        self._full_physical = 0
        self._scattered = False  # the pending sums are a ScatteredGrads (rows, reduced)

    @property
    def pending_batches(self) -> int:
        """Physical batches accumulated on this rank since the last :meth:`step`."""
        return self._full_physical

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add this rank's full-size clipped sum of one physical batch (fp32, kept locally),
        or take the :class:`~._rows.ScatteredGrads` of a level-2 ``grad_fn(...,
        reduce_scatter=True)`` call as the step's only physical batch (reduced already)."""
        import math

        import torch

        if not isinstance(grads, Mapping):
            raise InputTypeError(
                f"grads={type(grads).__name__}: expected the name -> tensor dict returned by "
                "clipped_grad's grad_fn"
            )
        max_norm = getattr(grads, "max_norm", None)
        if max_norm is None or not math.isfinite(float(max_norm)) or float(max_norm) <= 0:
            raise InputTypeError(
                f"grads.max_norm={max_norm!r}: pass the dict returned by clipped_grad's grad_fn "
                "(it carries its L2 sensitivity)"
            )
        scattered = isinstance(grads, ScatteredGrads)
        if self._full_physical and (scattered or self._scattered):
            raise OperationError(
                "ShardedDPOptimizer.accumulate(): a grad_fn(..., reduce_scatter=True) result is "
                "its logical step's only physical batch (it was reduce-scattered at once), and "
                f"{self._full_physical} physical batch(es) are already accumulated for this "
                "step. Pass reduce_scatter=True only for a step of one physical batch (step() "
                "after it), or drop it to accumulate several"
            )
        for name, value in grads.items():
            self._check_sum(name, value, scattered)
        for name, value in grads.items():
            value32 = value.detach().to(torch.float32)
            if name in self._full:
                self._full[name].add_(value32)
            else:
                self._full[name] = value32 if scattered else value32.clone()
        sensitivity = float(max_norm)
        self._full_sensitivity = (
            sensitivity
            if self._full_sensitivity is None
            else max(self._full_sensitivity, sensitivity)
        )
        self._full_physical += 1
        self._scattered = scattered

    def _check_sum(self, name: str, value: object, scattered: bool) -> None:
        """Refuse a sum the optimizer does not update, or not laid out as it should be: the
        full parameter's shape; for a scattered sum, the parameter's own layout (shards)."""
        import torch

        param = self._params.get(name)
        if param is None:
            raise ConfigurationError(
                f"gradient for {name!r}, which the optimizer does not update (its "
                f"parameters: {', '.join(self._params)})"
            )
        if scattered:
            laid_out = isinstance(value, torch.Tensor) and _is_sharded(value) == _is_sharded(param)
            if laid_out and _is_sharded(value) and _is_sharded(param):
                laid_out = tuple(value.placements) == tuple(param.placements)
            if not laid_out:
                raise InputTypeError(
                    f"grads[{name!r}]: a ScatteredGrads value must be laid out like its "
                    "parameter (pass what grad_fn(..., reduce_scatter=True) returned)"
                )
        if not isinstance(value, torch.Tensor) or (_is_sharded(value) and not scattered):
            raise InputTypeError(
                f"grads[{name!r}]: expected a plain full-size tensor (clipped_grad run on "
                "gather_full_params(...) with make_functional(compute_template(model)))"
            )
        if value.shape != param.shape:
            raise ConfigurationError(
                f"grads[{name!r}] has shape {tuple(value.shape)}; the full parameter has "
                f"{tuple(param.shape)}"
            )

    def step(self) -> StepReport:
        """Line the ranks up, check, reduce-scatter (a scattered result: reduced already), add
        each rank's rows of the noise, divide, update, account."""
        import torch

        from opake.dpsgd.clipping import ClippedGrads

        try:
            self._line_up()
            present, sensitivity, physical = self._agree_on_pending(
                self._full_physical, self._full_sensitivity, set(self._full)
            )
            # one parameter at a time, each full-size sum released once it is reduce-scattered
            pending, self._full = self._full, {}
            shards: dict[str, torch.Tensor] = {}
            for name in present:
                param = self._params[name]
                full = pending.pop(name, None)
                if self._scattered:  # this rank's rows of the global sum already
                    shards[name] = (
                        torch.zeros_like(param, dtype=torch.float32) if full is None else full
                    )
                    continue
                if full is None:
                    device = _local(param).device
                    full = torch.zeros(param.shape, dtype=torch.float32, device=device)
                shards[name] = self._reduce_scatter(full, param)
                del full
            del pending
            DPOptimizer.accumulate(self, ClippedGrads(shards, max_norm=sensitivity, batch_size=0))
            report = DPOptimizer.step(self)
        except BaseException:
            self._clear()
            raise
        return replace(report, physical_batches=physical)

    def logical_step(
        self,
        grad_fn: Callable[..., Any],
        params: Any,
        batches: Iterable[tuple[Any, ...] | Mapping[str, Any]],
        *,
        state: Any,
    ) -> tuple[StepReport, Any]:
        """:meth:`DistributedDPOptimizer.logical_step`; a level-2 ``grad_fn``
        (:func:`~opake.dpsgd.distributed.sharded_clipped_grad`, which runs the sharded module
        itself) is called without ``params`` (ignored: pass ``None``)."""
        from opake.dpsgd.distributed.sharded._grad_fn import ShardedClippedGradFn

        if isinstance(grad_fn, ShardedClippedGradFn):
            sharded = grad_fn

            def grad_fn(_params: Any, *batch: Any, **kwargs: Any) -> tuple[Any, ClipState]:
                return sharded(*batch, **kwargs)

        return super().logical_step(grad_fn, params, batches, state=state)

    def _line_up(self) -> None:
        """The step-start agreement (:func:`~._agree.line_up`, one small all-gather): raise on
        every rank when some rank runs one more level-2 ``grad_fn`` call instead of stepping
        (which would otherwise hang in the collectives until the timeout)."""
        from opake.dpsgd.distributed._agree import STEP, line_up, out_of_step

        if self._world_size == 1:
            return
        rows = line_up(STEP, self._group, pending=self._full_physical, scatter=int(self._scattered))
        problem = out_of_step(rows)
        if problem is not None:
            raise OperationError(f"{problem} (this is rank {self._rank})")

    def _reduce_scatter(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return reduce_rows(full, like, group=self._group, device=self._comm)

    def _clear(self) -> None:
        super()._clear()
        self._full = {}
        self._scattered = False
        self._full_sensitivity = None
        self._full_physical = 0

    def state_dict(self) -> dict[str, Any]:
        """Refused mid-accumulation (un-noised sums are never saved); see DPOptimizer."""
        if self._full_physical:
            raise OperationError(
                f"state_dict() with {self._full_physical} physical batch(es) accumulated and not "
                "yet stepped: the pending sum is un-noised private data and is never saved; call "
                "step() (or zero_grad()) first"
            )
        return super().state_dict()
