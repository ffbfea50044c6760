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

Level 2 (:mod:`opake.dpsgd.distributed.sharded`) replaces step 1 only: its ``grad_fn`` runs the
sharded module itself (FSDP gathers one unit at a time) and feeds steps 2-4 here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard, overload

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.distributed._comm import broadcast_tensors
from opake.dpsgd.distributed._optim import DistributedDPOptimizer, _BroadcastNoise, _NoiseProxy
from opake.dpsgd.optimizer._dp_optimizer import DPOptimizer, StepReport

if TYPE_CHECKING:
    from typing import Literal

    import torch
    from torch.distributed.tensor import DTensor

    from opake.dpsgd.noise._rows import NoiseRows

__all__ = ["ShardedDPOptimizer", "compute_template", "gather_full_params"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def _is_sharded(tensor: object) -> TypeGuard[DTensor]:
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (the tensor itself when it is not sharded)."""
    return tensor.to_local() if _is_sharded(tensor) else tensor


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


def _like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (identical on every rank) laid out like ``like``: its rows on this rank."""
    if not _is_sharded(like):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def _row_range(value: DTensor) -> tuple[int, int] | None:
    """The global rows ``[start, stop)`` this rank's local part of ``value`` holds, when it is
    sharded on dim 0 alone (FSDP2's layout); ``None`` for any other layout."""
    from torch.distributed.tensor import Shard

    try:  # DTensor's own layout arithmetic (a private helper: without it, the full draw)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - a PyTorch that moved it
        return None
    placements = tuple(value.placements)
    if value.ndim == 0 or placements != (Shard(0),) or type(placements[0]) is not Shard:
        return None
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, placements
    )
    if tuple(value.to_local().shape) != tuple(shape):
        return None
    start = int(offset[0]) if shape[0] else 0
    return start, start + int(shape[0])


def _rows_of(draw: NoiseRows, name: str, value: torch.Tensor) -> torch.Tensor:
    """The noise of ``value``'s elements on this rank, laid out like ``value``: only its own
    rows are drawn (dim-0 shards), else the parameter's full noise, redistributed."""
    if _is_sharded(value):
        rows = _row_range(value)
        if rows is not None:
            from torch.distributed.tensor import DTensor

            local = draw.rows(name, *rows, device=value.to_local().device)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
    full = draw.rows(name, 0, value.shape[0] if value.ndim else 1, device=_local(value).device)
    return _like(full, value)


class _ShardedNoise(_NoiseProxy):
    """One full-size draw (shared seed, or rank 0's broadcast), each rank adding its rows.

    With a :class:`~opake.dpsgd.noise.GaussianNoise` (its own ``add``) the draw is never
    materialised at once (:meth:`GaussianNoise.draw_rows`, bit for bit the full draw): with a
    shared key each rank generates only its rows, parameter by parameter; in broadcast mode
    rank 0 draws and broadcasts one parameter's full-size noise at a time. Other noise objects
    are drawn full-size, all parameters at once, as before."""

    def __init__(self, inner: Any, *, broadcast: bool, group: Any, device: torch.device) -> None:
        super().__init__(inner, group=group, device=device)
        self._broadcast = broadcast

    def _draws_rows(self) -> bool:
        """Whether the inner object is a GaussianNoise drawing as the class does (the same on
        every rank: the ranks agreed on their configuration)."""
        from opake.dpsgd.noise import GaussianNoise

        inner = self._inner
        return (
            isinstance(inner, GaussianNoise)
            and type(inner).add is GaussianNoise.add
            and type(inner).draw_rows is GaussianNoise.draw_rows
        )

    def _broadcast_by_parameter(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None
    ) -> dict[str, torch.Tensor]:
        """Rank 0's draw, one parameter's full-size noise at a time, broadcast; rows kept."""
        import torch
        import torch.distributed as dist

        names = list(grads)
        draw = None
        if dist.get_rank(self._group) == 0:
            draw = self._inner.draw_rows({n: grads[n].shape for n in names}, sensitivity)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            value = grads[name]
            device = _local(value).device
            if draw is not None:
                noise = draw.rows(name, 0, value.shape[0] if value.ndim else 1, device=device)
            else:
                noise = torch.zeros(value.shape, dtype=torch.float32, device=device)
            broadcast_tensors([noise], src=0, group=self._group, device=self._device)
            out[name] = value.to(torch.float32) + _like(noise, value)
        return out

    def add(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> dict[str, torch.Tensor]:
        import torch
        import torch.distributed as dist

        names = list(grads)
        if self._draws_rows():
            if sensitivity is None:
                sensitivity = getattr(grads, "max_norm", None)
            if self._broadcast:
                return self._broadcast_by_parameter(grads, sensitivity)
            draw = self._inner.draw_rows({n: grads[n].shape for n in names}, sensitivity)
            # one parameter's rows at a time: no full-size noise, no full-size zeros
            return {n: grads[n].to(torch.float32) + _rows_of(draw, n, grads[n]) for n in names}
        zeros = {
            n: torch.zeros(grads[n].shape, dtype=torch.float32, device=_local(grads[n]).device)
            for n in names
        }
        if self._broadcast:
            if dist.get_rank(self._group) == 0:
                out = self._inner.add(zeros, sensitivity=sensitivity)
                noise = [out[n].to(torch.float32) for n in names]
            else:
                noise = list(zeros.values())
            broadcast_tensors(noise, src=0, group=self._group, device=self._device)
        else:
            out = self._inner.add(zeros, sensitivity=sensitivity)
            noise = [out[n].to(torch.float32) for n in names]
        return {
            n: grads[n].to(torch.float32) + _like(z, grads[n])
            for n, z in zip(names, noise, strict=True)
        }

    __call__ = add

    def __repr__(self) -> str:
        how = "rank 0's draw" if self._broadcast else "a shared-seed draw"
        return f"ShardedNoise({self._inner!r}, rows of {how})"


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
    ``docs/design/fsdp2.md`` (level 2). Parameters that are not
    ``DTensor`` are all-reduced like in :class:`DistributedDPOptimizer`. Checkpoints of the
    sharded state are not supported by :func:`save_checkpoint_distributed`; the replica
    fingerprint check is off (shards differ by design).

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

    @property
    def pending_batches(self) -> int:
        """Physical batches accumulated on this rank since the last :meth:`step`."""
        return self._full_physical

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add this rank's full-size clipped sum of one physical batch (fp32, kept locally)."""
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
        for name, value in grads.items():
            param = self._params.get(name)
            if param is None:
                raise ConfigurationError(
                    f"gradient for {name!r}, which the optimizer does not update (its "
                    f"parameters: {', '.join(self._params)})"
                )
            if not isinstance(value, torch.Tensor) or _is_sharded(value):
                raise InputTypeError(
                    f"grads[{name!r}]: expected a plain full-size tensor (clipped_grad run on "
                    "gather_full_params(...) with make_functional(compute_template(model)))"
                )
            if value.shape != param.shape:
                raise ConfigurationError(
                    f"grads[{name!r}] has shape {tuple(value.shape)}; the full parameter has "
                    f"{tuple(param.shape)}"
                )
        for name, value in grads.items():
            value32 = value.detach().to(torch.float32)
            if name in self._full:
                self._full[name].add_(value32)
            else:
                self._full[name] = value32.clone()
        sensitivity = float(max_norm)
        self._full_sensitivity = (
            sensitivity
            if self._full_sensitivity is None
            else max(self._full_sensitivity, sensitivity)
        )
        self._full_physical += 1

    def step(self) -> StepReport:
        """Check, reduce-scatter, add each rank's rows of the noise, divide, update, account."""
        import torch

        from opake.dpsgd.clipping import ClippedGrads

        try:
            present, sensitivity, physical = self._agree_on_pending(
                self._full_physical, self._full_sensitivity, set(self._full)
            )
            # one parameter at a time, each full-size sum released once it is reduce-scattered
            pending, self._full = self._full, {}
            shards: dict[str, torch.Tensor] = {}
            for name in present:
                param = self._params[name]
                full = pending.pop(name, None)
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

    def _reduce_scatter(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not _is_sharded(like):
            buffer = full.to(self._comm).clone()
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group)
            return buffer.to(full.device)
        from torch.distributed.tensor import DTensor, Partial

        mesh = like.device_mesh
        partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
        return partial.redistribute(mesh, like.placements)

    def _clear(self) -> None:
        super()._clear()
        self._full = {}
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
