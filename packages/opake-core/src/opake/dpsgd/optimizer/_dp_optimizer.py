"""The DP optimizer step: noise once per logical step, divide by the expected batch size, step.

Implementation of :mod:`opake.dpsgd.optimizer` (the public façade).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OperationError,
)
from opake.dpsgd.optimizer._options import (
    _accounting_options,
    _check_delta,
    _divisor_and_rate,
    _from_sampler,
    _name_parameters,
    _positive_float,
    _resolve_noise,
    _sample_rate,
    check_sampler_rate,
    count_noise,
)
from opake.dpsgd.optimizer._physical import (
    _accepts_keyword,
    _noised,
    _same_keys,
    _split_batch,
    _with_aux,
    checked_grads,
)
from opake.dpsgd.optimizer._report import StepReport
from opake.dpsgd.optimizer._state import _STATE_VERSION, _checked_state, _SavedState
from opake.dpsgd.optimizer._unused import UnusedCheck

if TYPE_CHECKING:
    import torch

__all__ = ["DPOptimizer", "StepReport"]


class DPOptimizer:
    """Turn clipped gradient sums into a DP update with any ``torch.optim`` optimizer.

    One *logical* step: :meth:`accumulate` the clipped sums of one or more physical batches
    (added in fp32), then :meth:`step` adds Gaussian noise ``N(0, σ²·S²)`` **once** (fp32,
    ``S`` = the ``max_norm`` the gradients carry), divides by ``expected_batch_size`` — the
    *expected* size ``q·N`` of a Poisson batch, never the realised size, which would leak it —
    writes the result into each parameter's ``.grad`` (cast to its dtype), steps the wrapped
    optimizer and records the step in the accountant.

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over the trainable tensors.
        params: the ``nn.Module``, or the ``name -> tensor`` dict from ``make_functional``
            (its detached tensors share storage with the module's parameters and are matched
            to them), naming the optimizer's tensors; gradient dicts use these names.
        noise_multiplier: σ > 0; optional when ``noise`` is given (its σ is used).
        expected_batch_size: divisor of the noisy sum, ``sample_rate × dataset size``.
        sample_rate: Poisson rate q recorded in the accountant (required with ``accountant``).
        sampler: a ``PoissonSampler`` / ``FixedShapePoissonSampler`` from
            :mod:`opake.dpsgd.sampling`; supplies ``expected_batch_size``, ``sample_rate``
            and (fixed shape) ``max_batch_size``/``dataset_size``. Values also given
            explicitly must agree with it.
        accountant: an ``opake.accounting`` accountant; each logical step calls its ``step``.
        delta: when given with an accountant, every report carries ε(δ) so far.
        count_noise_multiplier: σ_b of adaptive clipping's noisy count, recorded with every
            step (``noise_multiplier`` is then the gradient's σ_Δ). With an accountant it is
            required as soon as adaptively clipped gradients arrive, through
            :meth:`accumulate` as well as :meth:`logical_step` (they carry their σ_b), and
            must match it: otherwise ε would be under-reported.
        max_batch_size: ``B_max`` of fixed-shape truncated Poisson sampling, recorded with
            every step together with ``dataset_size`` (the accountant adds the truncation term).
        dataset_size: N, the size of the dataset sampled from (with ``max_batch_size``).
        noise: an :class:`opake.dpsgd.noise.GaussianNoise` (or an object with the same
            ``add(grads, sensitivity=)``, ``noise_multiplier``, ``state_dict``); default:
            ``GaussianNoise(noise_multiplier, seed=seed, randomness=randomness)`` — secure
            (a ChaCha20 key from the operating system) unless ``seed`` is given.
        seed: ask for **reproducible, non-private** noise, keyed from this integer.
        randomness: an explicit :class:`~opake.dpsgd.randomness.Randomness` for the default
            noise (e.g. a secure key shared by the ranks of one run).
        secure: accepted for compatibility: ``True`` is the default; ``False`` needs ``seed``.
        offload_state: keep the optimizer's state (and a staging copy of the parameters) in
            CPU memory and run the update there; the update is the same computation, so it is
            DP-neutral (see :mod:`opake.dpsgd.optimizer._offload`).
        unused_params: ``"warn"`` (default) or ``"error"`` when a trainable parameter gets no
            gradient on the first step.

    Example:
        >>> import torch
        >>> from opake.dpsgd.optimizer import DPOptimizer
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> opt = DPOptimizer(torch.optim.SGD([w], lr=0.1), {"w": w}, noise_multiplier=1.1,
        ...                   expected_batch_size=4.0, seed=0)
        >>> class ClippedSum(dict): max_norm = 1.0  # what clipped_grad's grad_fn returns
        >>> opt.accumulate(ClippedSum(w=torch.tensor([1.0, 0.0, 0.5])))
        >>> report = opt.step()
        >>> report.step, report.noise_std, report.expected_batch_size, w.grad.shape
        (1, 1.1, 4.0, torch.Size([3]))
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        noise_multiplier: float | None = None,
        expected_batch_size: float | None = None,
        sample_rate: float | None = None,
        sampler: Any | None = None,
        accountant: Any | None = None,
        delta: float | None = None,
        count_noise_multiplier: float | None = None,
        max_batch_size: int | None = None,
        dataset_size: int | None = None,
        noise: Any | None = None,
        seed: int | None = None,
        randomness: Any | None = None,
        secure: bool | None = None,
        offload_state: bool = False,
        unused_params: Literal["warn", "error"] = "warn",
    ) -> None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(
                f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer "
                "(SGD, Adam, AdamW, ...) built over the trainable parameters"
            )
        self.optimizer = optimizer
        self._params = _name_parameters(optimizer, params)
        if sampler is not None:
            expected_batch_size, sample_rate, max_batch_size, dataset_size = _from_sampler(
                sampler,
                expected_batch_size=expected_batch_size,
                sample_rate=sample_rate,
                max_batch_size=max_batch_size,
                dataset_size=dataset_size,
                accounted=accountant is not None,
            )
        self._expected_batch_size, self._sample_rate = _divisor_and_rate(
            expected_batch_size, sample_rate, accountant
        )
        # the rate the sampler draws every batch at: the only one the accountant may record
        self._sampler_rate = self._sample_rate if sampler is not None else None
        self.accountant = accountant
        self.delta = _check_delta(delta, accountant)
        self._accounting = _accounting_options(
            accountant,
            count_noise_multiplier=count_noise_multiplier,
            max_batch_size=max_batch_size,
            dataset_size=dataset_size,
        )
        self._unused = UnusedCheck(unused_params)
        self.noise = _resolve_noise(
            noise, noise_multiplier, seed=seed, secure=secure, randomness=randomness
        )
        self._offload = None
        if offload_state:
            from opake.dpsgd.optimizer._offload import CPUStateOffload

            self._offload = CPUStateOffload(optimizer, self._params)
        self._sums: dict[str, torch.Tensor] = {}
        self._sensitivity: float | None = None
        self._physical = 0
        self._refusal: str | None = None  # why the pending step may not be released
        self._steps = 0

    # -- configuration ---------------------------------------------------------------------

    @property
    def noise_multiplier(self) -> float:
        """σ of the next step: the noise object's (settable between steps, accounted per step)."""
        return float(self.noise.noise_multiplier)

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.noise.noise_multiplier = _positive_float("noise_multiplier", value)

    @property
    def expected_batch_size(self) -> float:
        """Divisor of the noisy sum: the expected logical batch size ``q·N``."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float) -> None:
        self._expected_batch_size = _positive_float("expected_batch_size", value)

    @property
    def sample_rate(self) -> float | None:
        """Poisson rate q recorded in the accountant for the next step."""
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, value: float) -> None:
        rate = _sample_rate(value)
        check_sampler_rate(self._sampler_rate, rate, "sample_rate")
        self._sample_rate = rate

    @property
    def steps(self) -> int:
        """Logical steps taken so far."""
        return self._steps

    def count_noise(self, step: int) -> float | None:
        """Adaptive clipping's count noise for ``step`` (:func:`._options.count_noise`)."""
        return count_noise(self.noise, step)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names of the tensors the optimizer updates, in optimizer order."""
        return tuple(self._params)

    @property
    def pending_batches(self) -> int:
        """Physical batches accumulated since the last :meth:`step`."""
        return self._physical

    # -- the logical step ------------------------------------------------------------------

    def refuse_step(self, reason: str | None) -> None:
        """Mark the pending step as not to be released: the next :meth:`step` drops it and
        raises ``ConfigurationError(reason)`` before any noise is drawn — on every rank under
        ``torch.distributed`` (the ranks' per-step agreement carries it), so a check one rank
        fails cannot leave the others waiting in a collective. ``None`` changes nothing.
        ``DPTraining`` refuses a step that summed more examples than its sampler drew.
        """
        if reason is not None:
            self._refusal = str(reason)

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add the clipped gradient sum of one physical batch (fp32) to the current logical step.

        ``grads`` is what ``clipped_grad``'s ``grad_fn`` returns: a ``name -> tensor`` dict of
        *summed* clipped per-example gradients that carries ``max_norm`` (its L2 sensitivity).
        """
        import torch

        sensitivity = checked_grads(grads, self._params)
        self._check_count_accounted(getattr(grads, "count_noise_multiplier", None))
        for name, value in grads.items():
            # fp32, or wider (fp64 stays fp64); always a private copy, never the caller's tensor
            dtype = torch.promote_types(value.dtype, torch.float32)
            if name in self._sums:
                total = self._sums[name]
                total.add_(value.detach().to(device=total.device, dtype=total.dtype))
            else:
                self._sums[name] = value.detach().to(dtype=dtype, copy=True)
        self._sensitivity = (
            sensitivity if self._sensitivity is None else max(self._sensitivity, sensitivity)
        )
        self._physical += 1

    def step(self) -> StepReport:
        """Noise the accumulated sum once, divide by the expected batch size, step, account."""

        if self._physical == 0 or self._sensitivity is None:
            raise OperationError(
                "DPOptimizer.step() with nothing accumulated: call accumulate(grads) with the "
                "output of clipped_grad's grad_fn for every physical batch (an empty Poisson "
                "batch still returns zero gradients and must be accumulated)"
            )
        if self._refusal is not None:
            reason = self._refusal
            self._clear()
            raise ConfigurationError(reason)
        skipped = tuple(name for name in self._params if name not in self._sums)
        if not self._unused.done:
            try:
                self._unused.run(self._sums, skipped)
            except OperationError:
                self._clear()
                raise
        sensitivity = self._sensitivity
        sigma = self.noise_multiplier
        noised, owned = _noised(self.noise, self._sums, sensitivity)
        noisy = dict(noised)
        _same_keys(noisy, self._sums)
        # the noised sum replaces the sum: release each tensor as soon as it is replaced, so at
        # most one gradient-sized copy beyond the result exists
        self._sums.clear()
        grads: dict[str, torch.Tensor] = {}
        for name in list(noisy):
            value, size = noisy.pop(name), self._expected_batch_size
            # its own sums (noised in place) divided in place; a noise object's result is not
            grads[name] = value.div_(size) if owned else value / size
        for name, param in self._params.items():
            if name not in grads:
                param.grad = None
        # spent from here on: the update may reach the parameters even if it then raises (a
        # step hook, an out-of-memory error part-way through the parameter groups)
        if self.accountant is not None:
            self.accountant.step(
                noise_multiplier=sigma,
                sample_rate=self._sample_rate,
                num_steps=1,
                **self._accounting,
            )
        self._steps += 1
        try:
            self._release(grads)
        except BaseException as error:
            error.add_note(
                f"DPOptimizer: step {self._steps}'s noised gradients may have reached the "
                "parameters before this error; the step is counted as spent (accounted)"
            )
            self._clear()
            raise
        epsilon = None
        if self.accountant is not None and self.delta is not None:
            epsilon = float(self.accountant.get_epsilon(self.delta))
        report = StepReport(
            step=self._steps,
            noise_multiplier=sigma,
            sensitivity=sensitivity,
            noise_std=sigma * sensitivity,
            expected_batch_size=self._expected_batch_size,
            sample_rate=self._sample_rate if self.accountant is not None else None,
            physical_batches=self._physical,
            epsilon=epsilon,
            delta=self.delta if epsilon is not None else None,
            skipped_params=skipped,
        )
        self._clear()
        return report

    def _release(self, grads: dict[str, torch.Tensor]) -> None:
        """Hand the noised gradients to the wrapped optimizer (or the offloaded step)."""
        if self._offload is not None:
            self._offload.step(grads)
            return
        for name, value in grads.items():
            param = self._params[name]
            param.grad = value.to(device=param.device, dtype=param.dtype)
        self.optimizer.step()

    def logical_step(
        self,
        grad_fn: Callable[..., Any],
        params: Any,
        batches: Iterable[tuple[Any, ...] | Mapping[str, Any]],
        *,
        state: Any,
    ) -> tuple[StepReport, Any]:
        """One logical step from several physical batches: ``grad_fn`` on each, then :meth:`step`.

        ``batches`` holds the physical chunks of one Poisson-sampled logical batch, each either
        a tuple of ``grad_fn`` arguments after ``params`` (``grad_fn(params, *batch,
        state=state)``, e.g. ``(x, y)``) or a dict ``{"args": (x, y), **keywords}`` whose other
        keys are passed to ``grad_fn`` (e.g. ``example_mask`` of a fixed-shape batch). A
        ``grad_fn`` from ``clipped_grad`` is told ``end_step=False`` for every chunk but the
        last, so adaptive clipping updates its bound once per logical step. Returns the
        :class:`StepReport` (with each chunk's ``aux`` when ``grad_fn`` returns one) and the
        clipping state for the next call. On any error the partial accumulation is dropped.
        """
        if self._physical:
            raise OperationError(
                f"logical_step() with {self._physical} physical batch(es) already accumulated; "
                "call step() or zero_grad() first"
            )
        chunks = [_split_batch(batch) for batch in batches]
        if not chunks:
            raise ConfigurationError(
                "logical_step() got no physical batches; pass at least one (an empty Poisson "
                "batch is passed as a batch of size 0)"
            )
        self._check_clip_state(state)
        # the last step's .grad is not needed through this step's clipping (a non-private
        # loop's zero_grad() at the top of the step releases it the same way)
        self.zero_grad()
        takes_end_step = _accepts_keyword(grad_fn, "end_step")
        auxes = []
        try:
            for i, (args, kwargs) in enumerate(chunks):
                if takes_end_step:
                    kwargs.setdefault("end_step", i == len(chunks) - 1)
                out, state = grad_fn(params, *args, state=state, **kwargs)
                if isinstance(out, tuple):
                    out, aux = out
                    auxes.append(aux)
                self.accumulate(out)
            report = self.step()
        except BaseException:
            self._clear()
            raise
        if auxes:
            report = _with_aux(report, tuple(auxes))
        return report, state

    def _check_clip_state(self, state: Any) -> None:
        self._check_count_accounted(getattr(state, "count_noise_multiplier", None))

    def _check_count_accounted(self, sigma_b: Any) -> None:
        """Adaptive clipping's noisy count is a second query: refuse to account a step
        without it (every path: accumulate()/step() and logical_step())."""
        if sigma_b is None or self.accountant is None:
            return
        if self._accounting.get("count_noise_multiplier") != sigma_b:
            raise ConfigurationError(
                f"adaptive clipping with count_noise_multiplier={sigma_b!r}, but this DPOptimizer "
                f"records count_noise_multiplier="
                f"{self._accounting.get('count_noise_multiplier')!r}: the noisy count costs "
                "privacy and the accountant would under-report ε, so pass "
                "DPOptimizer(count_noise_multiplier=state.count_noise_multiplier) and let "
                "noise_multiplier be the gradient σ_Δ (opake.dpsgd.gradient_noise_multiplier)"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the pending accumulation and the parameters' ``.grad``."""
        self._clear()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param in self._params.values():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def _clear(self) -> None:
        self._sums = {}
        self._sensitivity = None
        self._physical = 0
        self._refusal = None

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, noise generator and step count (refused mid-accumulation).

        The pending clipped sum is never serialised: it is un-noised private data.
        """
        if self._physical:
            raise OperationError(
                f"state_dict() with {self._physical} physical batch(es) accumulated and not yet "
                "stepped: the pending sum is un-noised private data and is never saved; call "
                "step() (or zero_grad()) before checkpointing"
            )
        noise_state = self.noise.state_dict() if hasattr(self.noise, "state_dict") else None
        return {
            "version": _STATE_VERSION,
            "steps": self._steps,
            "unused_checked": self._unused.state(),
            "param_names": list(self._params),
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self._expected_batch_size,
            "sample_rate": self._sample_rate,
            "optimizer": self.optimizer.state_dict(),
            "noise": noise_state,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would refuse ``state`` for; change nothing."""
        self._checked(state)

    def _checked(self, state: Mapping[str, Any]) -> _SavedState:
        saved = _checked_state(state, list(self._params), self.noise, self.optimizer)
        check_sampler_rate(self._sampler_rate, saved.sample_rate, "the checkpoint's sample_rate")
        return saved

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (validated first; nothing changes on error)."""
        saved = self._checked(state)
        self.optimizer.load_state_dict(dict(state["optimizer"]))  # checked: a mapping
        if saved.noise is not None:
            self.noise.load_state_dict(saved.noise)
        else:
            self.noise.noise_multiplier = saved.noise_multiplier
        self._expected_batch_size = saved.expected_batch_size
        self._sample_rate = saved.sample_rate
        if self._offload is not None:
            self._offload.reset_masters()
        self._clear()
        self._steps = saved.steps
        self._unused.load(saved.checked)
