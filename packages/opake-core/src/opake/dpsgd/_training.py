"""One DP-SGD training step, composed once (implementation of :mod:`opake.dpsgd.training`).

:class:`DPTraining` owns every privacy-critical piece of the step — the Poisson sampler, the
clipped-gradient function (``clipped_grad``, engine ``auto``), the DP optimizer (noise once per
logical step, division by the expected batch size, all-reduce across ranks), the accountant and
the privacy budget — so that a training loop (``opake train``, ``DPTrainer``, a user's own
script) only moves data and reports.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import os

    import torch

__all__ = ["DPTraining", "PrivacyBudgetExhausted", "StepResult"]

logger = logging.getLogger("opake.core")

_STATE_VERSION = 1
_CONFIG_KEY = "opake.training"
_SAMPLERS = ("poisson", "fixed")
_ACCOUNTANTS = ("pld", "rdp")
_ENGINES = ("auto", "vmap", "bookkeeping")


class PrivacyBudgetExhausted(OperationError):  # noqa: N818 (a state, not a bug: reads better)
    """The next step would spend more than the target ε: no data was touched for it."""


@dataclass(frozen=True)
class StepResult:
    """What one logical step did (the diagnostics are this rank's and **not private**).

    Attributes:
        step: logical steps taken so far, this one included.
        report: the :class:`~opake.dpsgd.optimizer.StepReport` of the DP optimizer (σ, noise
            std, expected batch size, sample rate, physical batches of all ranks).
        batch_size: real examples this rank processed in the step (padding excluded).
        loss_sum: sum of their losses.
        clipped: how many of them were clipped.
        nonfinite: how many contributed zero because their gradient was not finite.
        aux: the clipping diagnostics (``ClipAux``) of each physical batch.
    """

    step: int
    report: Any
    batch_size: int
    loss_sum: float
    clipped: int
    nonfinite: int = 0
    aux: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def loss(self) -> float:
        """Mean loss of this rank's real examples (``nan`` for an empty batch)."""
        return self.loss_sum / self.batch_size if self.batch_size else float("nan")

    @property
    def clipping_rate(self) -> float:
        """Fraction of this rank's real examples that were clipped (0 for an empty batch)."""
        return self.clipped / self.batch_size if self.batch_size else 0.0


def _positive(name: str, value: object, *, integer: bool = False) -> Any:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InputTypeError(
            f"{name}={value!r} ({type(value).__name__}): expected "
            f"{'an int' if integer else 'a number'} > 0"
        )
    if integer:
        if int(value) < 1:
            raise ConfigurationError(f"{name}={value!r}: expected an int ≥ 1")
        return int(value)
    number = float(value)
    if not (number > 0.0 and math.isfinite(number)):
        raise ConfigurationError(f"{name}={value!r}: expected a finite number > 0")
    return number


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigurationError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return str(value)


class DPTraining:
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
        module: the ``nn.Module`` (replica checks and parameter broadcast across ranks).
        dataset_size: N, the number of examples sampled from.
        expected_batch_size: the expected *global* logical batch ``q·N`` (or ``sample_rate``).
        sample_rate: the Poisson rate q (or ``expected_batch_size``).
        noise_multiplier: σ; or give ``target_epsilon`` and ``steps`` to calibrate it.
        target_epsilon: the privacy budget: with ``steps`` and no ``noise_multiplier``, σ is
            calibrated so that ``steps`` steps spend it; in any case no step may exceed it.
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

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: torch.optim.Optimizer,
        params: Mapping[str, torch.Tensor],
        *,
        args: tuple[Any, ...] = (),
        batch_args: int = 1,
        module: Any = None,
        dataset_size: int,
        expected_batch_size: float | None = None,
        sample_rate: float | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        steps: int | None = None,
        delta: float,
        clipping_norm: Any = 1.0,
        engine: str = "auto",
        microbatch_size: int | None = None,
        randomness: str = "error",
        accountant: Any = "pld",
        accountant_options: Mapping[str, Any] | None = None,
        sampler: str = "poisson",
        max_batch_size: int | None = None,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        process_group: Any = None,
        offload_state: bool = False,
        unused_params: str = "warn",
        **unknown: Any,
    ) -> None:
        from opake import accounting
        from opake.dpsgd.clipping import clipped_grad
        from opake.dpsgd.distributed import DistributedDPOptimizer, current_context
        from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler

        if unknown:
            raise ConfigurationError(
                f"DPTraining() got an unknown keyword argument {next(iter(unknown))!r}"
            )
        if not isinstance(args, tuple):
            raise InputTypeError(f"args={type(args).__name__}: expected a tuple")
        if not isinstance(params, Mapping) or not params:
            raise InputTypeError(
                f"params={type(params).__name__}: expected the non-empty name -> tensor dict of "
                "trainable tensors (make_functional(model, partition_trainable=True))"
            )
        n = _positive("dataset_size", dataset_size, integer=True)
        self._batch_args = _positive("batch_args", batch_args, integer=True)
        q = _rate(expected_batch_size, sample_rate, n)
        delta = _positive("delta", delta)
        if delta >= 1.0:
            raise ConfigurationError(f"delta={delta!r}: expected a probability in (0, 1)")
        _choice("engine", engine, _ENGINES)
        _choice("sampler", sampler, _SAMPLERS)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InputTypeError(f"seed={seed!r}: expected None (secure) or an int ≥ 0")
        self._context = current_context(process_group)
        ctx = self._context
        self._accountant = _make_accountant(accountant, accountant_options)
        accounting_extra: dict[str, Any] = {}
        if sampler == "fixed":
            if max_batch_size is None:
                if steps is None:
                    raise ConfigurationError(
                        "sampler='fixed' without max_batch_size needs steps= (B_max is chosen "
                        "for the planned run); pass max_batch_size or steps"
                    )
                max_batch_size = min(
                    n,
                    accounting.max_batch_size_for(
                        dataset_size=n,
                        sample_rate=q,
                        steps=steps,
                        truncation_budget=accounting.truncation_budget_for(delta, target_epsilon),
                    ),
                )
            accounting_extra = {"max_batch_size": max_batch_size, "dataset_size": n}
        elif max_batch_size is not None:
            raise ConfigurationError("max_batch_size is for sampler='fixed'; drop it or use it")
        sigma = self._noise_multiplier(
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            steps=steps,
            q=q,
            delta=delta,
            extra=accounting_extra,
        )
        self._target = (
            None if target_epsilon is None else _positive("target_epsilon", target_epsilon)
        )
        self._delta = delta
        self._planned_steps = None if steps is None else _positive("steps", steps, integer=True)
        self._secure = seed is None
        # secure (default): batch membership from a key rank 0 drew and shared, never stored;
        # an int seed: reproducible and not private
        keyed: dict[str, Any] = (
            {"randomness": ctx.shared_randomness()} if seed is None else {"seed": seed}
        )
        shard = ctx.sampler_kwargs()
        if sampler == "fixed":
            assert max_batch_size is not None
            self._sampler: Any = FixedShapePoissonSampler(
                n, q, max_batch_size, steps_per_epoch=steps_per_epoch, **keyed, **shard
            )
        else:
            self._sampler = PoissonSampler(n, q, steps_per_epoch=steps_per_epoch, **keyed, **shard)
        first = 1 + len(args)
        self._args = args
        self._params = params
        self._grad_fn, self._clip_state = clipped_grad(
            loss_fn,
            argnums=0,
            clipping_norm=clipping_norm,
            batch_argnums=tuple(range(first, first + self._batch_args)),
            microbatch_size=microbatch_size,
            return_aux=True,
            randomness=randomness,
            method=engine,
        )
        count_sigma = getattr(self._clip_state, "count_noise_multiplier", None)
        self._optimizer = DistributedDPOptimizer(
            optimizer,
            module if module is not None else params,
            process_group=process_group,
            noise_multiplier=sigma,
            sampler=self._sampler,
            accountant=self._accountant,
            count_noise_multiplier=count_sigma,
            seed=seed,  # None: a secure noise key, shared by the ranks, never stored
            offload_state=offload_state,
            unused_params=unused_params,
        )
        self._accounting = {**self._sampler.accounting_kwargs, **accounting_extra}
        if count_sigma is not None:
            self._accounting["count_noise_multiplier"] = count_sigma
        self._hooks: list[Callable[[StepResult], None]] = []
        self._pending_aux: list[Any] = []
        self._budget_key: tuple[Any, ...] | None = None
        self._budget_end: int | None = None
        self._epsilon_cache: tuple[int, float, float] | None = None
        if self._target is not None:
            self._check_budget()

    # -- construction helpers ---------------------------------------------------------------

    def _noise_multiplier(
        self,
        *,
        noise_multiplier: float | None,
        target_epsilon: float | None,
        steps: int | None,
        q: float,
        delta: float,
        extra: dict[str, Any],
    ) -> float:
        from opake import accounting

        if noise_multiplier is not None:
            return float(_positive("noise_multiplier", noise_multiplier))
        if target_epsilon is None:
            raise ConfigurationError(
                "no noise: pass noise_multiplier=σ, or target_epsilon= with steps= to calibrate σ"
            )
        if steps is None:
            raise ConfigurationError(
                f"target_epsilon={target_epsilon!r} without noise_multiplier needs steps= (the "
                "planned number of logical steps) to calibrate σ"
            )
        kind = self._accountant.kind
        return accounting.calibrate_noise(
            target_epsilon=_positive("target_epsilon", target_epsilon),
            delta=delta,
            sample_rate=q,
            steps=_positive("steps", steps, integer=True),
            accountant=kind,
            accountant_options=self._accountant.options(),
            **extra,
        )

    # -- read-only views --------------------------------------------------------------------

    @property
    def sampler(self) -> Any:
        """The Poisson sampler (this rank's shard of the global batches)."""
        return self._sampler

    @property
    def optimizer(self) -> Any:
        """The DP optimizer (a ``DistributedDPOptimizer``, a plain one in a single process)."""
        return self._optimizer

    @property
    def grad_fn(self) -> Any:
        """The clipped-gradient function (``grad_fn.engine`` names the engine it took)."""
        return self._grad_fn

    @property
    def accountant(self) -> Any:
        return self._accountant

    @property
    def clip_state(self) -> Any:
        """The clipping state after the last step."""
        return self._clip_state

    @property
    def noise_multiplier(self) -> float:
        return self._optimizer.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return float(self._sampler.sample_rate)

    @property
    def expected_batch_size(self) -> float:
        """``q·N``, the divisor of the noisy sum (global, over all ranks)."""
        return float(self._sampler.expected_batch_size)

    @property
    def dataset_size(self) -> int:
        return int(self._sampler.dataset_size)

    @property
    def delta(self) -> float:
        return self._delta

    @property
    def target_epsilon(self) -> float | None:
        return self._target

    @property
    def secure(self) -> bool:
        """Noise and sampling from OS entropy (``seed=None``)."""
        return self._secure

    @property
    def steps(self) -> int:
        """Logical steps taken."""
        return int(self._optimizer.steps)

    @property
    def world_size(self) -> int:
        return int(self._context.world_size)

    @property
    def rank(self) -> int:
        return int(self._context.rank)

    # -- privacy -----------------------------------------------------------------------------

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the training's δ); cached per step."""
        d = self._delta if delta is None else float(_positive("delta", delta))
        cache = self._epsilon_cache
        if cache is not None and cache[0] == self.steps and cache[1] == d:
            return cache[2]
        value = float(self._accountant.get_epsilon(d)) if self._accountant.steps else 0.0
        self._epsilon_cache = (self.steps, d, value)
        return value

    @property
    def steps_left(self) -> int | None:
        """Logical steps the budget still allows at the current σ and q (``None``: no budget)."""
        if self._target is None:
            return None
        self._check_budget(raise_error=False)
        assert self._budget_end is not None
        return max(0, self._budget_end - self.steps)

    @property
    def exhausted(self) -> bool:
        """Whether the next step would spend more than ``target_epsilon``."""
        left = self.steps_left
        return left is not None and left == 0

    def _epsilon_after(self, extra_steps: int) -> float:
        from opake.accounting import accountant_from_state_dict

        trial = accountant_from_state_dict(self._accountant.state_dict())
        trial.step(
            noise_multiplier=self.noise_multiplier, num_steps=extra_steps, **self._accounting
        )
        return float(trial.get_epsilon(self._delta))

    def _check_budget(self, *, raise_error: bool = True) -> None:
        """Compute (once per σ and q) how many steps fit in the budget; raise if none left."""
        if self._target is None:
            return
        key = (self.noise_multiplier, self.sample_rate)
        if key != self._budget_key:
            self._budget_key = key
            self._budget_end = self.steps + self._steps_within(self._target)
        assert self._budget_end is not None
        if raise_error and self.steps >= self._budget_end:
            raise PrivacyBudgetExhausted(
                f"privacy budget spent: after {self.steps} step(s) ε = {self.epsilon():.4g} "
                f"(δ = {self._delta:.3g}), and one more step at σ = {self.noise_multiplier:.4g}, "
                f"q = {self.sample_rate:.4g} would exceed target_epsilon = {self._target:g}. "
                "Stop training here (the model trained so far is (ε, δ)-DP), or raise the "
                "target knowingly"
            )

    def _steps_within(self, target: float) -> int:
        """Largest k ≥ 0 with ε(history + k steps) ≤ target (exponential + binary search)."""
        guess = (self._planned_steps or 0) - self.steps
        if guess > 0 and self._epsilon_after(guess) <= target:
            # σ calibrated for the planned run: usually exactly the planned steps fit
            if self._epsilon_after(guess + 1) > target:
                return guess
            low, high = guess + 1, 2 * guess + 2
        elif self._epsilon_after(1) > target:
            return 0
        else:
            low, high = 1, 2
        while self._epsilon_after(high) <= target:
            low, high = high, high * 2
            if high > 1 << 40:
                return high
        while high - low > 1:
            mid = (low + high) // 2
            if self._epsilon_after(mid) <= target:
                low = mid
            else:
                high = mid
        return low

    # -- data --------------------------------------------------------------------------------

    def batches(self) -> Iterator[list[int]]:
        """This rank's index batches, one per logical step, without end (epochs follow on).

        Fixed-shape sampling pads with :data:`~opake.dpsgd.sampling.PADDING_INDEX`: pass
        ``example_mask=padding_mask(indices)`` to :meth:`step` / :meth:`accumulate`.
        """
        while True:
            yield from self._sampler

    # -- the step ----------------------------------------------------------------------------

    def accumulate(self, *batch: Any, example_mask: torch.Tensor | None = None) -> Any:
        """Clip and sum one physical batch into the pending logical step (no noise yet).

        Returns the batch's ``ClipAux`` (per-example losses and norms: **not private**).
        """
        if len(batch) != self._batch_args:
            raise ConfigurationError(
                f"accumulate() got {len(batch)} batched argument(s); this training was built "
                f"with batch_args={self._batch_args}"
            )
        if not self._pending_aux:
            self._check_budget()  # refuse before touching the data of a step we may not take
        kwargs: dict[str, Any] = {"end_step": False}
        if example_mask is not None:
            kwargs["example_mask"] = example_mask
        try:
            (grads, aux), self._clip_state = self._grad_fn(
                self._params, *self._args, *batch, state=self._clip_state, **kwargs
            )
            self._optimizer.accumulate(grads)
        except BaseException:
            self.zero_grad()
            raise
        self._pending_aux.append((aux, example_mask))
        return aux

    def finish_step(self) -> StepResult:
        """Noise the accumulated sum once, update, account, run the hooks."""
        if not self._pending_aux:
            raise OperationError(
                "finish_step() with nothing accumulated: call accumulate(...) for every physical "
                "batch of the step (an empty Poisson batch too: it contributes zeros)"
            )
        try:
            self._check_budget()
            report = self._optimizer.step()
        except BaseException:
            self.zero_grad()
            raise
        self._clip_state = self._clip_state.end_step(reduce=self._optimizer.all_reduce_sum)
        result = _result(report, self._pending_aux)
        self._pending_aux = []
        for hook in list(self._hooks):
            hook(result)
        return result

    def step(self, *batch: Any, example_mask: torch.Tensor | None = None) -> StepResult:
        """One logical step from one physical batch: :meth:`accumulate` then :meth:`finish_step`."""
        self.accumulate(*batch, example_mask=example_mask)
        return self.finish_step()

    def logical_step(self, physical: Iterable[tuple[Any, ...] | Mapping[str, Any]]) -> StepResult:
        """One logical step from several physical batches (tuples of batched arguments, or
        dicts ``{"args": (...), "example_mask": mask}``)."""
        count = 0
        for item in physical:
            if isinstance(item, Mapping):
                extra = set(item) - {"args", "example_mask"}
                if extra or not isinstance(item.get("args"), tuple):
                    raise ConfigurationError(
                        "a physical batch dict holds 'args' (a tuple) and optionally "
                        f"'example_mask'; got keys {sorted(item)}"
                    )
                self.accumulate(*item["args"], example_mask=item.get("example_mask"))
            elif isinstance(item, tuple):
                self.accumulate(*item)
            else:
                self.zero_grad()
                raise InputTypeError(
                    f"physical batch {type(item).__name__}: expected a tuple of batched arguments"
                )
            count += 1
        if not count:
            raise ConfigurationError("logical_step() got no physical batch")
        return self.finish_step()

    def zero_grad(self) -> None:
        """Drop a pending accumulation (nothing noised, nothing accounted)."""
        self._pending_aux = []
        self._optimizer.zero_grad()

    def set_params(
        self, params: Mapping[str, torch.Tensor], *, args: tuple[Any, ...] | None = None
    ) -> None:
        """Point the gradient function at new tensors (same names and shapes), e.g. after a
        wrapper (DDP, a device move) replaced the module's parameter storage; ``args`` replaces
        the fixed arguments too. The optimizer keeps updating the module's parameters."""
        if self._pending_aux:
            raise OperationError("set_params() in the middle of a logical step")
        if not isinstance(params, Mapping) or set(params) != set(self._params):
            raise ConfigurationError(
                "set_params(): expected the same parameter names as at construction"
            )
        for name, value in params.items():
            if tuple(value.shape) != tuple(self._params[name].shape):
                raise ConfigurationError(
                    f"set_params(): {name!r} has shape {tuple(value.shape)}, expected "
                    f"{tuple(self._params[name].shape)}"
                )
        if args is not None:
            if not isinstance(args, tuple) or len(args) != len(self._args):
                raise ConfigurationError(
                    f"set_params(args=...): expected a tuple of {len(self._args)} argument(s)"
                )
            self._args = args
        self._params = params

    @property
    def pending_batches(self) -> int:
        """Physical batches accumulated into the step in progress."""
        return len(self._pending_aux)

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

    def _config(self) -> dict[str, Any]:
        return {
            "dataset_size": self.dataset_size,
            "sample_rate": self.sample_rate,
            "delta": self._delta,
            "target_epsilon": self._target,
            "world_size": self.world_size,
            "secure": self._secure,
        }

    def _check_config(self, saved: Any) -> None:
        if not isinstance(saved, Mapping):
            raise ConfigurationError("the saved training state has no configuration")
        mine = self._config()
        diffs = [
            f"{key} {saved.get(key)!r} (saved) vs {value!r} (now)"
            for key, value in mine.items()
            if key != "world_size" and saved.get(key) != value
        ]
        if diffs:
            raise ConfigurationError(
                "the saved training state was made with other settings: "
                + "; ".join(diffs)
                + "; resume with the saved settings (they decide the privacy accounting)"
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides the model: optimizer, noise generator, sampler
        position (= logical steps taken), accountant history, clipping state.

        Refused while physical batches are pending (their un-noised sum is never saved).
        """
        if self._pending_aux:
            raise OperationError(
                "state_dict() in the middle of a logical step: call finish_step() first (the "
                "pending clipped sum is un-noised private data and is never saved)"
            )
        sampler = self._sampler.state_dict()
        sampler["position"] = self.steps
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "optimizer": self._optimizer.state_dict(),
            "accountant": self._accountant.state_dict(),
            "sampler": sampler,
            "clip_state": self._clip_state.to_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next step equals the uninterrupted run's (seeded)."""
        from opake.dpsgd.clipping import clip_state_from_dict

        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigurationError(
                "expected the dict from DPTraining.state_dict() (version "
                f"{_STATE_VERSION}); got {type(state).__name__}"
            )
        self._check_config(state.get("config"))
        clip = clip_state_from_dict(state["clip_state"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._accountant.load_state_dict(state["accountant"])
        self._sampler.load_state_dict(state["sampler"])
        self._clip_state = clip
        self._after_load()

    def _after_load(self) -> None:
        self._pending_aux = []
        self._budget_key = None
        self._epsilon_cache = None
        if self._sampler.position != self.steps:
            self._sampler.seek(self.steps)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        model: Any = None,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        collective: bool = True,
    ) -> Path:
        """Write the training state (and ``model``, if given) atomically to ``path``.

        Every rank calls it under ``torch.distributed``; rank 0 writes (see
        ``save_checkpoint_distributed``). With ``collective=False`` this process writes alone
        (no collective: call it on one rank only; the state is the same on every rank).
        ``extra``: plain values returned by :meth:`load`.
        """
        from opake.dpsgd.checkpoint import save_checkpoint
        from opake.dpsgd.distributed import save_checkpoint_distributed

        if self._pending_aux:
            raise OperationError(
                "save() in the middle of a logical step: call finish_step() first (the pending "
                "clipped sum is un-noised private data and is never saved)"
            )
        payload = dict(extra or {})
        if _CONFIG_KEY in payload:
            raise ConfigurationError(f"extra key {_CONFIG_KEY!r} is reserved")
        payload[_CONFIG_KEY] = self._config()
        position = self._sampler.position
        self._sampler.seek(self.steps)  # a prefetching loader may have drawn ahead
        common = {
            "step": self.steps,
            "model": model,
            "optimizer": self._optimizer,
            "accountant": self._accountant,
            "sampler": self._sampler,
            "clip_state": self._clip_state,
            "extra": payload,
            "rng": rng,
        }
        try:
            if not collective:
                return save_checkpoint(path, **common)
            return save_checkpoint_distributed(path, group=self._context.group, **common)
        finally:
            self._sampler.seek(position)

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        model: Any = None,
        rng: bool = True,
        collective: bool = True,
    ) -> dict[str, Any]:
        """Restore what :meth:`save` wrote (every rank); returns the saved ``extra``.

        ``collective=False`` reads without collectives (each rank may call it on its own).
        """
        from opake.dpsgd.checkpoint import load_checkpoint
        from opake.dpsgd.distributed import load_checkpoint_distributed

        common = {
            "model": model,
            "optimizer": self._optimizer,
            "accountant": self._accountant,
            "sampler": self._sampler,
            "clip_state": self._clip_state,
            "rng": rng,
            "strict": model is not None,
        }
        if collective:
            ckpt = load_checkpoint_distributed(path, group=self._context.group, **common)
        else:
            ckpt = load_checkpoint(path, **common)
        extra = dict(ckpt.extra)
        config = extra.pop(_CONFIG_KEY, None)
        if config is not None:
            self._check_config(config)
        # else: a checkpoint of the same components written without DPTraining (e.g. an
        # earlier opake train): the optimizer, sampler and accountant were each validated and
        # restored above (a file without an accountant is refused), so nothing is forgotten
        if ckpt.clip_state is not None:
            self._clip_state = ckpt.clip_state
        self._after_load()
        return extra

    def __repr__(self) -> str:
        return (
            f"DPTraining(steps={self.steps}, σ={self.noise_multiplier:.4g}, "
            f"q={self.sample_rate:.4g}, N={self.dataset_size}, δ={self._delta:.3g}, "
            f"target_epsilon={self._target}, world_size={self.world_size}, "
            f"{'secure' if self._secure else 'seeded'})"
        )


def _rate(expected: float | None, rate: float | None, n: int) -> float:
    if (expected is None) == (rate is None):
        raise ConfigurationError(
            "pass exactly one of expected_batch_size (q·N, global) and sample_rate (q)"
        )
    if expected is not None:
        b = _positive("expected_batch_size", expected)
        if b > n:
            raise ConfigurationError(
                f"expected_batch_size={expected!r} exceeds dataset_size={n}; the expected "
                "Poisson batch must be at most the dataset"
            )
        return b / n
    q = _positive("sample_rate", rate)
    if q > 1.0:
        raise ConfigurationError(f"sample_rate={rate!r}: expected a probability in (0, 1]")
    return float(q)


def _make_accountant(accountant: Any, options: Mapping[str, Any] | None) -> Any:
    from opake import accounting

    if isinstance(accountant, str):
        _choice("accountant", accountant, _ACCOUNTANTS)
        return accounting.make_accountant(accountant, **dict(options or {}))
    if options:
        raise ConfigurationError(
            "accountant_options are for a named accountant; configure the accountant object"
        )
    if not isinstance(accountant, accounting.PrivacyAccountant):
        raise InputTypeError(
            f"accountant={type(accountant).__name__}: expected 'pld', 'rdp' or an "
            "opake.accounting accountant"
        )
    if accountant.steps:
        raise ConfigurationError(
            "the accountant already holds steps; pass a fresh one (resume with load())"
        )
    return accountant


def _result(report: Any, pending: list[tuple[Any, Any]]) -> StepResult:
    import torch

    count = 0
    loss_sum = 0.0
    clipped = 0
    nonfinite = 0
    for aux, mask in pending:
        losses = aux.loss_values
        real = int(aux.batch_size)
        if mask is not None:  # padding slots of a fixed-shape batch: not examples
            losses = losses[mask.to(device=losses.device, dtype=torch.bool)]
        count += real
        if losses.numel():
            loss_sum += float(losses.detach().float().sum())
        clipped += round(float(aux.clipping_rate) * real)
        nonfinite += int(getattr(aux, "nonfinite_count", 0) or 0)
    return StepResult(
        step=int(report.step),
        report=report,
        batch_size=count,
        loss_sum=loss_sum,
        clipped=clipped,
        nonfinite=nonfinite,
        aux=tuple(aux for aux, _ in pending),
    )
