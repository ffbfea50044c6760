"""Data-parallel DP-SGD: reduce the clipped sums across ranks, then noise once (implementation).

:class:`DistributedDPOptimizer` is a :class:`~opake.dpsgd.optimizer.DPOptimizer` whose
:meth:`~DistributedDPOptimizer.step` first SUM-all-reduces, in fp32, the clipped per-example
gradient sums every rank accumulated for its shard of the global Poisson batch, and only then
lets :class:`DPOptimizer` add the Gaussian noise — once, to the global sum — divide by the
global expected batch size, update and account. Every rank ends the step with the same
parameters. See ``docs/guide/distributed.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.distributed._agree import (
    _config_problems,
    _local_config,
    drifted_samplers,
    sampler_position,
)
from opake.dpsgd.distributed._comm import all_reduce_tensors, broadcast_tensors
from opake.dpsgd.distributed._env import _world
from opake.dpsgd.distributed._replicas import (
    _comm_device,
    _gather_rows,
    _replica_tensors,
    _structure_hash,
    check_replicas_in_sync,
    unwrap_ddp,
)
from opake.dpsgd.optimizer._dp_optimizer import DPOptimizer, StepReport
from opake.dpsgd.optimizer._options import reserve_count

if TYPE_CHECKING:
    import torch

__all__ = ["DistributedDPOptimizer", "check_replicas_in_sync", "unwrap_ddp"]

NoiseSync = Literal["auto", "replicated", "broadcast"]
_NOISE_SYNC = ("auto", "replicated", "broadcast")
_DDP_PREFIX = "module."
#: the agreement row's first column of parameter presence (before it: batches, sensitivity,
#: structure, sampler position, refusal, noise multiplier)
_PRESENCE = 6


class _NoiseProxy:
    """A noise object wrapping another: ``noise_multiplier`` and every other attribute
    (``state_dict`` / ``load_state_dict`` / ``secure`` / ``seed``, iff the inner object has
    them) are the inner object's; subclasses change how ``add`` draws across ranks."""

    def __init__(self, inner: Any, *, group: Any, device: torch.device) -> None:
        self._inner = inner
        self._group = group
        self._device = device

    @property
    def inner(self) -> Any:  # Any: the user's noise object is duck-typed, like DPOptimizer's
        """The noise object that draws."""
        return self._inner

    @property
    def noise_multiplier(self) -> float:
        return float(self._inner.noise_multiplier)

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._inner.noise_multiplier = value

    def __getattr__(self, name: str) -> Any:  # Any: whatever the inner object holds
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _BroadcastNoise(_NoiseProxy):
    """Rank 0 draws the noise (e.g. from OS entropy) and broadcasts the noised sum."""

    def __init__(self, inner: Any, *, rank: int, group: Any, device: torch.device) -> None:
        super().__init__(inner, group=group, device=device)
        self._rank = rank

    def add(
        self, grads: Mapping[str, torch.Tensor], sensitivity: float | None = None
    ) -> dict[str, torch.Tensor]:
        import torch

        names = list(grads)
        if self._rank == 0:
            out = self._inner.add(dict(grads), sensitivity=sensitivity)
            if isinstance(out, tuple):
                out = out[0]
            if not isinstance(out, Mapping) or set(out) != set(names):
                raise OperationError(
                    "the noise object returned a different set of entries than it was given"
                )
            values = [out[n].detach().to(torch.float32).clone() for n in names]
        else:
            values = [
                torch.empty(grads[n].shape, dtype=torch.float32, device=grads[n].device)
                for n in names
            ]
        broadcast_tensors(values, src=0, group=self._group, device=self._device)
        return dict(zip(names, values, strict=True))

    __call__ = add

    def __repr__(self) -> str:
        return f"BroadcastNoise({self._inner!r}, from rank 0)"


class DistributedDPOptimizer(DPOptimizer):
    """:class:`~opake.dpsgd.optimizer.DPOptimizer` for data-parallel training (DDP-style).

    Every rank computes the clipped per-example gradient sums of its own shard of the global
    Poisson batch (``PoissonSampler(..., rank=, world_size=)``) and :meth:`accumulate`-s them
    as usual. :meth:`step` then

    1. checks, in one small all-gather, that every rank accumulated at least one (possibly
       empty) physical batch, that all clipped to the same sensitivity and that every rank's
       ``sampler=`` has handed out as many batches (their shards are one global draw: a rank
       that skipped or repeated a batch raises :class:`~opake.core.errors.OperationError` on
       every rank, nothing noised or accounted);
    2. SUM-all-reduces the fp32 sums (bucketed) — a rank with an empty shard contributes
       zeros, so no rank ever waits on a collective the others skip;
    3. adds Gaussian noise **once** to the global sum — every rank draws the *same* noise
       from a shared key (``noise_sync="replicated"``: by default a secure key drawn on rank 0
       and shared at construction, never stored; or the same ``seed=``), or rank 0 draws it
       and broadcasts the noised sum (``"broadcast"``, for ``secure=True`` or a noise object
       whose key only rank 0 has);
    4. divides by the *global* expected batch size ``q·N``, updates, and records the step with
       the global sample rate q in the accountant — identically on every rank.

    Gradient accumulation (several :meth:`accumulate` calls) and ``clipped_grad``'s
    microbatching stay local; there is one reduction per logical step. Opake never calls
    ``backward()`` on the module's own parameters, so a ``DistributedDataParallel`` wrapper's
    gradient hooks never fire and nothing is reduced twice; ``no_sync`` is not needed. Pass
    the DDP module (it is unwrapped) and build ``make_functional`` on ``unwrap_ddp(model)``.

    Args:
        optimizer: the ``torch.optim`` optimizer over the trainable tensors (same on all ranks).
        params: the module (or its DDP wrapper), or the ``name -> tensor`` dict.
        process_group: the group to reduce over (default: the default group). Without an
            initialised process group the optimizer runs as a single process.
        noise_sync: ``"replicated"``, ``"broadcast"`` or ``"auto"`` (broadcast for secure noise
            or a noise object without a seed, replicated otherwise).
        broadcast_parameters: copy rank 0's parameters (and a module's buffers) to every rank
            at construction, so replicas start identical (as DDP does).
        check_sync_every: every this many steps (and after the first), verify that all ranks
            hold identical parameters (one 2-float all-gather; 0 disables).
        **options: every :class:`~opake.dpsgd.optimizer.DPOptimizer` keyword argument. With
            several ranks, no ``seed=``/``randomness=``/``noise=``/``secure=`` shares a secure
            noise key drawn on rank 0 (never stored); a ``sampler=`` must be this rank's shard.

    Construction compares the configuration of every rank (noise seed, sampler seed and rate,
    expected batch size, σ, the parameters' names and shapes) and raises
    :class:`~opake.core.errors.ConfigurationError` on every rank if they differ.

    Example (one process; under ``torchrun`` the same code reduces across ranks):
        >>> import torch
        >>> from opake.dpsgd.distributed import DistributedDPOptimizer
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = DistributedDPOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
        ...                              noise_multiplier=1.0, expected_batch_size=4.0, seed=0)
        >>> opt.world_size, opt.noise_sync
        (1, 'replicated')
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        process_group: Any = None,
        noise_sync: NoiseSync = "auto",
        broadcast_parameters: bool = True,
        check_sync_every: int = 100,
        **options: Any,
    ) -> None:
        import torch

        if noise_sync not in _NOISE_SYNC:
            raise ConfigurationError(
                f"noise_sync={noise_sync!r}: expected one of {', '.join(_NOISE_SYNC)}"
            )
        if not isinstance(broadcast_parameters, bool):
            raise InputTypeError(f"broadcast_parameters={broadcast_parameters!r}: expected a bool")
        if (
            isinstance(check_sync_every, bool)
            or not isinstance(check_sync_every, int)
            or check_sync_every < 0
        ):
            raise ConfigurationError(
                f"check_sync_every={check_sync_every!r}: expected an int ≥ 0 (0 disables the check)"
            )
        self._ddp_wrapped = isinstance(params, torch.nn.parallel.DistributedDataParallel)
        params = unwrap_ddp(params)
        rank, world_size = _world(process_group)
        self._group = process_group
        self._rank = rank
        self._world_size = world_size
        self._check_every = check_sync_every
        self._comm = _comm_device(process_group)
        named = _replica_tensors(params)
        self._structure = _structure_hash(named)
        self._replicas = params
        # read at every step: which sampler batch this rank's shard came from
        self._sampler = options.get("sampler")
        mode = self._resolve_noise_sync(noise_sync, options)
        if world_size > 1:
            self._agree(options, mode)
            if broadcast_parameters:
                broadcast_tensors(
                    [t for _, t in named], src=0, group=process_group, device=self._comm
                )
        super().__init__(optimizer, params, **options)
        self._noise_sync: Literal["replicated", "broadcast"] = mode
        if world_size > 1 and mode == "broadcast":
            self.noise = _BroadcastNoise(
                self.noise, rank=rank, group=process_group, device=self._comm
            )

    # -- configuration ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the reduction group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks whose sums are reduced (1: a single process)."""
        return self._world_size

    @property
    def noise_sync(self) -> Literal["replicated", "broadcast"]:
        """How ranks obtain identical noise: same seed (replicated) or rank 0's (broadcast)."""
        return self._noise_sync

    def _resolve_noise_sync(
        self, requested: NoiseSync, options: dict[str, Any]
    ) -> Literal["replicated", "broadcast"]:
        noise = options.get("noise")
        # explicit secure=True or a secure noise object: its key is this rank's own
        secure = bool(options.get("secure", False)) or bool(getattr(noise, "secure", False))
        seeded = noise is None or getattr(noise, "seed", None) is not None
        if requested == "replicated" and secure:
            raise ConfigurationError(
                "noise_sync='replicated' with secure noise: secure draws come from fresh OS "
                "entropy and cannot be replayed on other ranks; use noise_sync='broadcast' (rank "
                "0 draws, the noised sum is broadcast) or 'auto'"
            )
        if requested == "replicated" and not seeded:
            raise ConfigurationError(
                f"noise_sync='replicated' with noise={type(noise).__name__} that has no seed: "
                "ranks could not draw identical noise; give it a seed or use 'broadcast'"
            )
        if requested != "auto":
            return requested
        return "broadcast" if secure or not seeded else "replicated"

    def _agree(self, options: dict[str, Any], mode: str) -> None:
        """One all-gather of every rank's configuration; raise on every rank if they differ."""
        import torch.distributed as dist

        mine = _local_config(options, mode, structure=self._structure, rank=self._rank)
        everyone: list[Any] = [None] * self._world_size
        dist.all_gather_object(everyone, mine, group=self._group)
        problems = _config_problems(everyone, self._world_size)
        if problems:
            raise ConfigurationError(
                "DistributedDPOptimizer: the ranks are not configured alike: "
                + "; ".join(problems)
                + ". Every rank must build the same model, optimizer, sampler (its own shard of "
                "the same global sampling) and noise, from the same seeds"
            )
        if everyone[0]["proposed_key"] is not None:
            from opake.dpsgd.randomness import Randomness

            options["randomness"] = Randomness.from_key(everyone[0]["proposed_key"])

    # -- the logical step ------------------------------------------------------------------

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add this rank's clipped sum of one physical batch (see :meth:`DPOptimizer.accumulate`).

        Nothing is communicated here: the reduction happens once, in :meth:`step`.
        """
        if self._ddp_wrapped and isinstance(grads, Mapping):
            prefixed = [n for n in grads if isinstance(n, str) and n.startswith(_DDP_PREFIX)]
            if prefixed and prefixed[0] not in self.param_names:
                raise ConfigurationError(
                    f"gradient for {prefixed[0]!r}: these gradients were computed through the "
                    "DistributedDataParallel wrapper (make_functional(ddp_model)). DDP's forward "
                    "may run collectives a different number of times on each rank under Poisson "
                    "sampling and deadlock; build the functional model on the inner module: "
                    "make_functional(unwrap_ddp(model))"
                )
        super().accumulate(grads)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM of ``tensor`` over the ranks (a new tensor; the input itself in one process).

        The ``reduce=`` hook of ``AdaptiveClipping.end_step``: with adaptive clipping and
        manual :meth:`accumulate`/:meth:`step`, call ``grad_fn(..., end_step=False)`` for every
        physical batch and then ``state = state.end_step(reduce=opt.all_reduce_sum,
        unit_noise=opt.count_noise(state.step))`` on every rank (:meth:`logical_step` does this
        for you).
        """
        import torch
        import torch.distributed as dist

        if self._world_size == 1:
            return tensor
        buffer = tensor.detach().to(device=self._comm, dtype=torch.float64).clone()
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group)
        return buffer.to(device=tensor.device)

    def step(self) -> StepReport:
        """Reduce every rank's sums, then noise once, divide, update and account (every rank).

        ``StepReport.physical_batches`` counts the physical batches of all ranks.
        """
        if self._world_size > 1:
            try:
                self._reduce_pending()
            except BaseException:
                self._clear()
                raise
        report = super().step()
        if self._check_every and (report.step == 1 or report.step % self._check_every == 0):
            check_replicas_in_sync(
                self._replicas, group=self._group, what=f"parameters after step {report.step}"
            )
        return report

    def _reduce_pending(self) -> None:
        import torch

        present, sensitivity, physical = self._agree_on_pending(
            self._physical, self._sensitivity, set(self._sums)
        )
        local = []
        for name in present:
            value = self._sums.get(name)
            if value is None:
                param = self._params[name]
                value = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            local.append(value)
        reduced = all_reduce_tensors(local, group=self._group, device=self._comm)
        self._sums = dict(zip(present, reduced, strict=True))
        self._sensitivity = sensitivity
        self._physical = physical

    def _agree_on_pending(
        self, physical: int, sensitivity: float | None, names_present: set[str]
    ) -> tuple[list[str], float, int]:
        """One all-gather of (batches, sensitivity, structure, sampler position, refusal, σ,
        presence) from every rank.

        Returns the parameters with a gradient on any rank (optimizer order), the common
        sensitivity and the total number of physical batches; raises on every rank when the
        parameter structures differ, the samplers handed out different numbers of batches
        (the shards are not one global draw), a rank refused the step, the noise multipliers
        differ, a rank accumulated nothing or the sensitivities differ.
        """
        import torch

        names = list(self.param_names)
        world = self._world_size
        row = torch.zeros(_PRESENCE + len(names), dtype=torch.float64)
        row[0] = float(physical)
        row[1] = float("nan") if sensitivity is None else float(sensitivity)
        row[2] = float(self._structure)
        row[3] = float(sampler_position(self._sampler))
        row[4] = 0.0 if self._refusal is None else 1.0
        row[5] = float(self.noise_multiplier)
        for k, name in enumerate(names):
            row[_PRESENCE + k] = 1.0 if name in names_present else 0.0
        rows = _gather_rows(row, group=self._group, world_size=world)
        if bool((rows[:, 2] != rows[0, 2]).any()):
            raise ConfigurationError(
                "the ranks' parameters differ in names, shapes or dtypes; every rank must build "
                "the same model and optimizer"
            )
        drift = drifted_samplers([int(p) for p in rows[:, 3].tolist()], self.steps)
        if drift is not None:
            raise OperationError(
                f"{type(self).__name__}.step(): {drift} (this is rank {self._rank})"
            )
        refused = [r for r in range(world) if rows[r, 4] > 0]
        if refused:
            reason = self._refusal or "their steps may not be released"
            raise ConfigurationError(
                f"{type(self).__name__}.step(): rank(s) {refused} refused this step: {reason} "
                f"(this is rank {self._rank})"
            )
        sigmas = rows[:, 5].tolist()
        if any(sigma != sigmas[0] for sigma in sigmas):
            raise ConfigurationError(
                f"{type(self).__name__}.step(): the ranks' noise multipliers differ {sigmas} "
                f"(this is rank {self._rank}): replicas noised from one draw at two scales "
                "would reveal the noise (their difference) and the clipped sum with it. Set "
                "noise_multiplier on every rank together; nothing was noised"
            )
        idle = [r for r in range(world) if rows[r, 0] == 0]
        if idle:
            raise OperationError(
                f"{type(self).__name__}.step(): rank(s) {idle} accumulated nothing for this "
                f"step (this is rank {self._rank}). Every rank must accumulate at least one "
                "physical batch per logical step — an empty Poisson shard is still passed "
                "through grad_fn (it returns zeros) and accumulated"
            )
        sens = rows[:, 1].tolist()
        if any(not math.isclose(s, sens[0], rel_tol=1e-9) for s in sens):
            raise ConfigurationError(
                f"the ranks clipped to different sensitivities {sens}: the noise is calibrated to "
                "one bound, so every rank must use the same clipping_norm (and, with adaptive "
                "clipping, the same state seed and the reduce= hook)"
            )
        present = [name for k, name in enumerate(names) if bool((rows[:, _PRESENCE + k] > 0).any())]
        return present, float(sens[0]), int(rows[:, 0].sum())

    def logical_step(
        self,
        grad_fn: Callable[..., Any],
        params: Any,
        batches: Iterable[tuple[Any, ...] | Mapping[str, Any]],
        *,
        state: Any,
    ) -> tuple[StepReport, Any]:
        """:meth:`DPOptimizer.logical_step` on this rank's physical batches, then reduce.

        With :class:`~opake.dpsgd.clipping.AdaptiveClipping` the clipping bound is updated
        once, from the count summed over all ranks, with one count noise drawn by rank 0 from
        its noise source and broadcast (``end_step(reduce=self.all_reduce_sum,
        unit_noise=self.count_noise(state.step))``), so every rank keeps the same bound. A
        state with an integer ``seed`` (public count noise) is refused when the noise is
        secure.
        """
        from opake.dpsgd.clipping import AdaptiveClipping

        if self._world_size == 1 or not isinstance(state, AdaptiveClipping):
            return super().logical_step(grad_fn, params, batches, state=state)
        if state.seed is not None and bool(getattr(self.noise, "secure", False)):
            raise ConfigurationError(
                f"AdaptiveClipping(seed={state.seed}) with secure noise: its count noise would "
                "come from that public seed, so whoever holds it recovers each step's exact "
                "count from the clipping norms and the reported ε does not hold; drop seed= "
                "(the ranks then share one count noise drawn by rank 0)"
            )

        def local_grad_fn(*args: Any, end_step: bool = True, **kwargs: Any) -> object:
            return grad_fn(*args, end_step=False, **kwargs)

        report, state = super().logical_step(local_grad_fn, params, batches, state=state)
        unit = None if state.seed is not None else self.count_noise(state.step)
        return report, state.end_step(reduce=self.all_reduce_sum, unit_noise=unit)

    def count_noise(self, step: int) -> float:
        """Adaptive clipping's count noise for ``step``, identical on every rank: rank 0 draws
        it from its noise source (the OS entropy pool if that has none) and broadcasts it."""
        import random

        import torch

        # the other ranks take the index as rank 0 does: each refuses a state that redraws it
        value = super().count_noise(step) if self._rank == 0 else reserve_count(self.noise, step)
        if value is None:
            value = random.SystemRandom().gauss(0.0, 1.0)
        shared = torch.tensor([value], dtype=torch.float64, device=self._comm)
        if self._world_size > 1:
            broadcast_tensors([shared], src=0, group=self._group, device=self._comm)
        return float(shared[0])
