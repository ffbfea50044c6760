"""One DP-SGD training step, composed once (implementation of :mod:`opake.dpsgd.training`).

:class:`DPTraining` owns every privacy-critical piece of the step, so that a training loop
(``opake train``, ``DPTrainer``, a user's own script) only moves data and reports.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext as _nothing
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.dpsgd.training._budget import Budget, Spending
from opake.dpsgd.training._clipping import build_clipping, clipped_sum
from opake.dpsgd.training._drawn import drawn_problem
from opake.dpsgd.training._options import (
    _accounting_of,
    _calibrated_sigma,
    _check_arguments,
    _check_choices,
    _check_delta,
    _check_new_params,
    _check_privacy_units,
    _fixed_shape,
    _make_accountant,
    _make_sampler,
    _physical_batch,
    _positive,
    _rate,
    check_count_seed,
    step_count_noise,
)
from opake.dpsgd.training._persist import TrainingState
from opake.dpsgd.training._result import PrivacyBudgetExhausted, StepResult, _result
from opake.dpsgd.training._sharded import ShardedStep, check_shard, dp_optimizer
from opake.dpsgd.training._units import StepUnits

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from opake.accounting import PrivacyAccountant
    from opake.dpsgd.clipping import ClipAux, ClipState

__all__ = ["DPTraining", "PrivacyBudgetExhausted", "StepResult"]


class DPTraining(TrainingState):
    """The DP-SGD training step: sampling, clipping, noise, update, accounting, budget.

    One object holds the sampler, the clipped-gradient function, the DP optimizer, the
    accountant and the privacy budget. A loop draws index batches from :meth:`batches`, loads
    the examples, and calls :meth:`step` (one physical batch per logical step) or
    :meth:`accumulate` for each physical batch then :meth:`finish_step` (gradient
    accumulation). Each logical step adds the noise once, divides by the *expected* batch size
    ``q·N``, steps the wrapped optimizer and records the step in the accountant; a step that
    would spend more than ``target_epsilon`` raises :class:`PrivacyBudgetExhausted` before
    any example is touched. Under ``torch.distributed`` each rank draws its shard of the global
    Poisson batch and the clipped sums are all-reduced before the noise.

    The differentiated argument is ``params`` (a ``name -> tensor`` dict, e.g. ``trainable``
    from ``make_functional(model, partition_trainable=True)``); the gradient function is called
    as ``loss_fn(params, *args, *batch)`` where ``args`` are fixed (e.g. the frozen weights)
    and ``batch`` holds ``batch_args`` batched arguments. ``loss_fn`` is a one-example loss or a
    :class:`~opake.dpsgd.bookkeeping.BatchedLoss` (which lets ``engine="auto"`` pick the
    book-keeping engine).

    Args:
        loss_fn: the per-example loss (see :func:`~opake.dpsgd.clipping.clipped_grad`).
        optimizer: any ``torch.optim.Optimizer`` over the tensors of ``params``.
        params: the trainable ``name -> tensor`` dict (sharing storage with the module).
        args: fixed positional arguments between ``params`` and the batch (default none).
        batch_args: how many batched arguments follow (default 1).
        module: the ``nn.Module`` (replica checks and parameter broadcast across ranks), or
            a ``name -> tensor`` dict of the tensors to check and broadcast (default ``params``).
        dataset_size: N, the number of examples sampled from.
        expected_batch_size: the expected *global* logical batch ``q·N`` (or ``sample_rate``).
        sample_rate: the Poisson rate q (or ``expected_batch_size``).
        noise_multiplier: σ; or give ``target_epsilon`` and ``steps`` to calibrate it.
        target_epsilon: the privacy budget: with ``steps`` and no ``noise_multiplier``, σ is
            calibrated so that ``steps`` steps spend it (adaptive clipping's count included);
            in any case no step may take the accountant's ε past it (a shared accountant's
            steps of other runs included).
        steps: the planned number of logical steps (for the calibration).
        delta: δ of the (ε, δ) guarantee.
        clipping_norm: C, or a clipping state (``opake.dpsgd.clipping``).
        engine: ``"auto"`` (default), ``"vmap"`` or ``"bookkeeping"``.
        microbatch_size: examples per chunk inside ``clipped_grad`` (``None``: one chunk).
        randomness: ``vmap`` randomness (``"different"`` for dropout).
        accountant: ``"pld"`` (default), ``"rdp"`` or an ``opake.accounting`` accountant.
        accountant_options: options of a named accountant.
        sampler: ``"poisson"`` (default) or ``"fixed"`` (truncated Poisson with
            ``max_batch_size`` slots, accounted with the truncation term).
        max_batch_size: ``B_max`` of fixed-shape sampling (default: ``max_batch_size_for``
            with a truncation budget of δ/1000).
        steps_per_epoch: sampler batches per epoch (default ``round(1/q)``).
        seed: ``None`` (default): noise and batch membership from a secure key (drawn from the
            operating system on rank 0, shared with the other ranks, never stored); an int:
            reproducible sampling and noise, **not private** (tests, debugging).
        process_group: the ``torch.distributed`` group (default: the default group if any).
        offload_state: keep the optimizer state in CPU memory (see ``DPOptimizer``).
        unused_params: ``"warn"`` or ``"error"`` for trainable tensors without gradient.
        privacy_units: each record's privacy unit (a user id, an author; ``dataset_size``
            entries) for **user-level DP**: Poisson sampling draws units
            (:class:`~opake.dpsgd.sampling.UnitPoissonSampler`; ``expected_batch_size`` and
            ``sample_rate`` count units), each unit's gradient — the sum over its records in
            the step — is clipped to C as one, and ε holds per unit. Steps then take
            ``records=`` (the indices :meth:`batches` yielded) instead of ``units=``. Poisson
            sampling in one process only.
        max_records_per_unit: with ``privacy_units``, at most this many records of one unit per
            step (a random subset drawn with the sampler's randomness; default all).
        compile: compile the clipped-gradient computation with ``torch.compile`` (vmap engine,
            one graph). The graph has one batch shape: each physical batch runs as chunks of
            ``microbatch_size`` rows (default with ``sampler="fixed"``: ``B_max``; Poisson
            sampling needs ``microbatch_size``), the last chunk padded with masked rows that
            add exactly zero. The first call compiles (seconds to minutes); refused with the
            book-keeping engine, privacy units and ``AdaptiveClipping``.
        shard: per-layer sharded compute (FSDP2 level 2, ``docs/guide/distributed.md``): under
            an initialised process group, ``module`` is the ``fully_shard``-ed model, ``params``
            its trainable parameters by name, ``loss_fn(*batch)`` runs the model and returns
            per-example losses ``[B]``; the sums come from
            :func:`~opake.dpsgd.distributed.sharded_clipped_grad` (book-keeping), the update
            from :class:`~opake.dpsgd.distributed.ShardedDPOptimizer`. :meth:`save` /
            :meth:`load` write and read a directory of shards (same world size);
            :meth:`state_dict` is refused. Refused: the vmap engine, ``compile``, adaptive
            clipping, ``privacy_units``, ``args``, ``offload_state``, ``sampler="fixed"``.

    Example:
        >>> import torch
        >>> from opake.dpsgd.training import DPTraining
        >>> from opake.functional import make_functional
        >>> net = torch.nn.Linear(3, 1)
        >>> fmodel, params = make_functional(net)
        >>> def loss_fn(p, x, y):  # one example
        ...     return (fmodel(p, x[None])[0, 0] - y) ** 2
        >>> training = DPTraining(loss_fn, torch.optim.SGD(net.parameters(), lr=0.1), params,
        ...                       batch_args=2, dataset_size=100, expected_batch_size=10,
        ...                       noise_multiplier=1.0, delta=1e-5, seed=0)
        >>> X, Y = torch.randn(100, 3), torch.randn(100)
        >>> for _, indices in zip(range(3), training.batches()):
        ...     result = training.step(X[indices], Y[indices])
        >>> result.step, training.steps, training.epsilon() > 0
        (3, 3, True)
    """

    _hooks: list[Callable[[StepResult], None]]
    _pending_aux: list[Any]
    _step_state: ClipState | None

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: torch.optim.Optimizer,
        params: Mapping[str, torch.Tensor],
        *,
        args: tuple[Any, ...] = (),
        batch_args: int = 1,
        module: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        dataset_size: int,
        expected_batch_size: float | None = None,
        sample_rate: float | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        steps: int | None = None,
        delta: float,
        clipping_norm: float | Mapping[str, float] | ClipState = 1.0,
        engine: str = "auto",
        microbatch_size: int | None = None,
        randomness: str = "error",
        accountant: str | PrivacyAccountant = "pld",
        accountant_options: Mapping[str, Any] | None = None,
        sampler: str = "poisson",
        max_batch_size: int | None = None,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        process_group: ProcessGroup | None = None,
        offload_state: bool = False,
        unused_params: str = "warn",
        privacy_units: Sequence[Hashable] | None = None,
        max_records_per_unit: int | None = None,
        compile: bool = False,
        shard: bool = False,
        **unknown: Any,
    ) -> None:
        from opake.dpsgd.distributed import current_context

        n, self._batch_args = _check_arguments(unknown, args, params, dataset_size, batch_args)
        _check_choices(engine, sampler, seed, rates=(sample_rate, expected_batch_size))
        settings = (engine, compile, privacy_units, args, offload_state, clipping_norm, sampler)
        self._shard, group = check_shard(shard, module, params, process_group, settings)
        self._context = current_context(group)
        units = _check_privacy_units(
            privacy_units, max_records_per_unit, n, sampler, self._context.world_size
        )
        # the population Poisson sampling draws from (and ε protects): examples, or units
        q = _rate(expected_batch_size, sample_rate, n if units is None else units.count)
        self._delta = delta = _check_delta(delta)
        self._accountant = _make_accountant(accountant, accountant_options)
        extra = _fixed_shape(
            sampler, max_batch_size, n, q, steps, delta=delta, target=target_epsilon
        )
        plan = (noise_multiplier, target_epsilon, steps, q)
        sigma = _calibrated_sigma(self._accountant, plan, delta, extra, clipping_norm)
        budget = Budget.checked(target_epsilon, steps)
        self._secure = seed is None
        self._sampler = _make_sampler(
            sampler, n, q, extra, self._context, how=(steps_per_epoch, seed, units)
        )
        self._args, self._params = args, params
        self._grad_fn, self._clip_state, self._compiled = build_clipping(
            loss_fn,
            clipping_norm,
            engine=engine,
            how=(microbatch_size, randomness, compile),
            units=units,
            layout=(self._shard, len(args), self._batch_args, self._sampler),
        )
        check_count_seed(self._clip_state, self._secure)
        parts = (self._sampler, self._accountant, self._clip_state)
        how = (group, sigma, seed, offload_state, unused_params)
        target = module if module is not None else params
        self._optimizer = dp_optimizer(optimizer, target, self._shard, how, parts)
        accounting = _accounting_of(self._sampler, extra, self._clip_state)
        self._spending = Spending(self._accountant, accounting, delta, budget)
        self._hooks, self._units = [], StepUnits(self._sampler if units is not None else None)
        self._after_load()  # no step pending, no budget or ε computed yet
        self._check_budget()

    # -- privacy -----------------------------------------------------------------------------

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the training's δ); cached per step."""
        d = None if delta is None else float(_positive("delta", delta))
        return self._spending.epsilon(self.steps, d)

    @property
    def steps_left(self) -> int | None:
        """Logical steps the budget still allows at the current σ and q (``None``: no budget)."""
        return self._spending.steps_left(self.steps, self.noise_multiplier, self.sample_rate)

    @property
    def exhausted(self) -> bool:
        """Whether the next step would spend more than ``target_epsilon``."""
        return self.steps_left == 0

    def _check_budget(self) -> None:
        """Raise :class:`PrivacyBudgetExhausted` when the budget allows no further step."""
        self._spending.check(self.steps, self.noise_multiplier, self.sample_rate)

    # -- data --------------------------------------------------------------------------------

    def batches(self) -> Iterator[list[int]]:
        """This rank's index batches, one per logical step, without end (epochs follow on).

        Fixed-shape sampling pads with :data:`~opake.dpsgd.sampling.PADDING_INDEX`: pass
        ``example_mask=padding_mask(indices)`` to :meth:`step` / :meth:`accumulate`.
        """
        while True:
            yield from self._sampler

    # -- the step ----------------------------------------------------------------------------

    def accumulate(
        self,
        *batch: Any,
        example_mask: torch.Tensor | None = None,
        units: torch.Tensor | None = None,
        records: Sequence[int] | torch.Tensor | None = None,
    ) -> ClipAux:
        """Clip and sum one physical batch into the pending logical step (no noise yet).

        ``units``: each row's privacy unit (int ``[B]`` on the batch's device), clipped as a
        whole (``grad_fn(..., units=)``); a unit's rows must all be in one physical batch of
        the step (a unit seen again raises ``ConfigurationError``), and one process (refused
        under ``torch.distributed``). Without ``privacy_units``, ``units`` needs ``records``:
        each row's record index (from :meth:`batches`, a record's rows repeating it: DPO's
        chosen-then-rejected rows take ``records=indices * 2``); each unit must be the rows of
        one drawn record and each drawn record's rows one unit, every record of the step's
        drawn batch once (checked over the step, padding rows masked out). ``records``: with
        ``privacy_units=``, required instead of ``units`` — the units come from the unit
        sampler; alone on a plain step (one row per example, one process), it checks the rows
        themselves: each real row a record drawn for the step, none summed twice, every drawn
        record there by :meth:`finish_step` (a loop loading one example twice in place of
        another passes the step's count check, not this). A step's batches all pass
        ``records=`` or none does. Returns the batch's ``ClipAux`` (**not private**).
        """
        if len(batch) != self._batch_args:
            raise ConfigurationError(
                f"accumulate() got {len(batch)} batched argument(s); this training was built "
                f"with batch_args={self._batch_args}"
            )
        try:
            units, rows = self._units.check(
                units,
                records,
                batch,
                example_mask,
                step=self.steps,
                world_size=self.world_size,
                sampler=self._sampler,
            )
        except BaseException:
            self.zero_grad()  # a refused physical batch drops its step, as the docs say
            raise
        if self._step_state is None:  # a new logical step
            self._check_budget()  # refuse before touching the data of a step we may not take
            # the clip state as the step found it: a dropped step (zero_grad) restores it, so
            # adaptive clipping's count never holds the units of a step that was not taken
            self._step_state = self._clip_state
            # a new logical step: the last step's ``.grad`` (one gradient-sized tensor per
            # parameter) is not needed through this step's clipping, as a non-private loop's
            # ``zero_grad()`` at the top of the step would release it
            self._optimizer.zero_grad()
        try:
            grads, aux, self._clip_state = clipped_sum(
                (self._grad_fn, self._compiled),
                self._params,
                self._args,
                batch,
                state=self._clip_state,
                example_mask=example_mask,
                units=units,
            )
            self._optimizer.accumulate(grads)
        except BaseException:
            self.zero_grad()
            raise
        self._pending_aux.append((aux, example_mask))
        self._units.commit(rows)
        out: ClipAux = aux
        return out

    @property
    def compiled(self) -> bool:
        """Whether the clipped-gradient computation is compiled (``compile=True``)."""
        return self._compiled is not None

    def finish_step(self) -> StepResult:
        """Noise the accumulated sum once, update, account, run the hooks."""
        if not self._pending_aux:
            raise OperationError(
                "finish_step() with nothing accumulated: call accumulate(...) for every physical "
                "batch of the step (an empty Poisson batch too: it contributes zeros)"
            )
        try:
            self._units.check_complete(self._sampler, self.steps)
            # refused by the optimizer (on every rank, under torch.distributed)
            self._optimizer.refuse_step(drawn_problem(self._pending_aux, self._sampler, self.steps))
            self._check_budget()
            report = self._optimizer.step()
        except BaseException:
            self.zero_grad()
            raise
        unit = step_count_noise(self._clip_state, self._optimizer)
        self._clip_state = self._clip_state.end_step(
            reduce=self._optimizer.all_reduce_sum, unit_noise=unit
        )
        result = _result(report, self._pending_aux)
        self._pending_aux, self._step_state = [], None
        self._units.reset()
        self._new_step()
        for hook in list(self._hooks):
            hook(result)
        return result

    def step(
        self,
        *batch: Any,
        example_mask: torch.Tensor | None = None,
        units: torch.Tensor | None = None,
        records: Sequence[int] | torch.Tensor | None = None,
    ) -> StepResult:
        """One logical step from one physical batch: :meth:`accumulate` then :meth:`finish_step`
        (with ``shard=True`` on a new step, each parameter's sum is reduce-scattered as it is
        formed: one full-size sum alive per rank). ``units`` comes with ``records`` (each row's
        record index) unless the training has ``privacy_units`` (then ``records`` alone)."""
        grad_fn: object = self._grad_fn
        whole = self._step_state is None and isinstance(grad_fn, ShardedStep)
        with grad_fn.whole_step() if isinstance(grad_fn, ShardedStep) and whole else _nothing():
            self.accumulate(*batch, example_mask=example_mask, units=units, records=records)
        return self.finish_step()

    def logical_step(self, physical: Iterable[tuple[Any, ...] | Mapping[str, Any]]) -> StepResult:
        """One logical step from several physical batches (tuples of batched arguments, or
        dicts ``{"args": (...), "example_mask": mask, "units": ids, "records": indices}``)."""
        count = 0
        for item in physical:
            try:
                args, mask, units, records = _physical_batch(item)
            except (ConfigurationError, InputTypeError):
                self.zero_grad()  # the step is dropped: nothing noised, nothing accounted
                raise
            self.accumulate(*args, example_mask=mask, units=units, records=records)
            count += 1
        if not count:
            raise ConfigurationError("logical_step() got no physical batch")
        return self.finish_step()

    def zero_grad(self) -> None:
        """Drop a pending accumulation (nothing noised, nothing accounted; the clip state is
        the one the step started with)."""
        if self._step_state is not None:
            self._clip_state = self._step_state
        self._pending_aux, self._step_state = [], None
        self._units.reset()
        self._optimizer.zero_grad()
        self._new_step()

    def _new_step(self) -> None:
        """Tell a sharded step function that the next call starts a logical step."""
        if isinstance(self._grad_fn, ShardedStep):
            self._grad_fn.new_step()

    def set_params(
        self, params: Mapping[str, torch.Tensor], *, args: tuple[Any, ...] | None = None
    ) -> None:
        """Point the gradient function at new tensors (same names and shapes), e.g. after a
        wrapper (DDP, a device move) replaced the module's parameter storage; ``args`` replaces
        the fixed arguments too. The optimizer keeps updating the module's parameters."""
        if self._pending_aux:
            raise OperationError("set_params() in the middle of a logical step")
        if self._shard is not None:
            raise OperationError("set_params() with shard=True: the step runs the sharded module")
        self._args = _check_new_params(self._params, self._args, params, args)
        self._params = params

    def add_hook(self, hook: Callable[[StepResult], None]) -> Callable[[], None]:
        """Call ``hook(result)`` after every logical step; returns a function removing it."""
        if not callable(hook):
            raise InputTypeError(f"hook={hook!r}: expected a callable taking a StepResult")
        self._hooks.append(hook)

        def remove() -> None:
            if hook in self._hooks:
                self._hooks.remove(hook)

        return remove

    # -- state -------------------------------------------------------------------------------

    def _after_load(self) -> None:
        self._pending_aux, self._step_state = [], None
        self._units.reset()
        self._spending.reset()
        if self._sampler.position != self.steps:
            self._sampler.seek(self.steps)
