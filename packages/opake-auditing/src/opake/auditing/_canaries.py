"""Gradient (white-box) canaries: examples of an audit layer, sent through the run's clipping
engine and the DP optimizer — plain ones, and ones crafted against the book-keeping engine's
numerics (:mod:`._crafted`). Input (black-box) canaries are in :mod:`._input`."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, overload

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from opake.auditing._crafted import Geometry
    from opake.dpsgd.clipping import ClippedGrads
    from opake.dpsgd.optimizer import DPOptimizer, StepReport
    from opake.dpsgd.training import DPTraining, StepResult

__all__ = [
    "CANARY_ENGINES",
    "CANARY_PARAMETER",
    "CRAFTED_KINDS",
    "KINDS",
    "CanaryRun",
    "GradientCanaries",
    "step_quietly",
]

#: name of the audit parameter in the dicts given to the optimizer and to ``DPOptimizer``: the
#: weight (``R × K``, fp32) of the audit layer ``opake_audit.canaries``, an ``nn.Linear`` the
#: model never reads
CANARY_PARAMETER = "opake_audit.canaries.weight"
KINDS = ("dirac", "random")
#: the kinds of gradient canaries crafted against the book-keeping engine's numerics (see
#: :class:`GradientCanaries`)
CRAFTED_KINDS = ("cancellation", "underflow", "absorption")
#: engines a canary run can send its canaries through (``clipped_grad(engine=...)``)
CANARY_ENGINES = ("auto", "bookkeeping", "vmap")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r}: expected an int >= 1")
    return value


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected a number")
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"{name}={value!r}: expected a finite number > 0")
    return float(value)


def _engine(value: object) -> str:
    if value not in CANARY_ENGINES:
        raise ConfigurationError(
            f"engine={value!r}: expected one of {', '.join(CANARY_ENGINES)} (the clipping engine "
            "the run's own examples go through, e.g. training.grad_fn.engine)"
        )
    return str(value)


class GradientCanaries:
    """White-box canaries: examples of a dedicated audit layer, each with a known gradient
    direction, sent through the run's clipping engine.

    Canary i is one example of the audit layer ``opake_audit.canaries`` (an ``nn.Linear`` the
    model never reads, so the data's gradients do not blur it; its weight is
    :data:`CANARY_PARAMETER`) over a short sequence of tokens. Its gradient has norm
    ``gradient_norm × C``, far beyond the clipping bound C, along a unit direction ``p qᵀ`` the
    auditor knows; it goes through the real ``clipped_grad`` — the book-keeping engine when the
    run uses it, the vmap engine otherwise — the sampler (canary i is dataset index
    ``dataset_size + i``), ``DPOptimizer`` (noise once, division by the expected batch) and the
    accountant: the mechanism as built.

    Kinds (canary i has kind ``kinds[i % len(kinds)]``, public: the guesses are also made per
    kind, see :func:`~opake.auditing.one_run_audit`):

    - ``kind``: ``"dirac"`` (one coordinate of the audit matrix) or ``"random"`` (a random
      rank-one direction), an example as plain as it comes;
    - with ``crafted=True`` (default), the kinds of :data:`CRAFTED_KINDS`, crafted against the
      book-keeping engine's numerics: their true norm is ``gradient_norm × C`` but their fp32
      Gram ("ghost") norm is exactly 0 — per-token terms that are huge and cancel
      (``"cancellation"``), inputs whose fp32 squares underflow next to huge output gradients
      (``"underflow"``), small products absorbed by round-to-nearest-even after large ones in
      a block's fp32 reduction (``"absorption"``). A correct engine clips them to C (it proves
      its bounds for every input); an engine that trusts its computed Gram norm lets them
      through whole.

    Args:
        count: m, the number of canaries.
        kind: the plain kind, ``"dirac"`` or ``"random"``.
        crafted: add the crafted kinds (each gets its share of the m canaries).
        gradient_norm: the canary gradient's norm as a multiple of C (default 100: a clipping
            fault lets it through at up to this many times C).
        seed: seed of the random directions (``None``: OS entropy). Not a secret: the auditor
            knows the directions.

    Example:
        >>> canaries = GradientCanaries(8, seed=0)
        >>> canaries.labels[:4]
        ('dirac', 'cancellation', 'underflow', 'absorption')
        >>> canaries.directions().shape  # m unit directions of the R × K audit matrix
        torch.Size([8, 16384])
    """

    kind_name = "gradient"

    def __init__(
        self,
        count: int = 1000,
        *,
        kind: str = "dirac",
        crafted: bool = True,
        gradient_norm: float = 100.0,
        seed: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigurationError(
                f"GradientCanaries() got unknown keyword argument(s) {sorted(unknown)}; accepted: "
                "count, kind, crafted, gradient_norm, seed (the audit matrix's shape follows "
                "from count)"
            )
        self.count = _positive_int("count", count)
        if kind not in KINDS:
            raise ConfigurationError(
                f"kind={kind!r}: expected one of {', '.join(KINDS)} (the crafted kinds come with "
                "crafted=True)"
            )
        if not isinstance(crafted, bool):
            raise InputTypeError(f"crafted={crafted!r}: expected True or False")
        self.kind = kind
        self.crafted = crafted
        self.gradient_norm = _positive("gradient_norm", gradient_norm)
        self.seed = secrets.randbits(63) if seed is None else seed
        self._geometry: Geometry | None = None

    def __len__(self) -> int:
        return self.count

    @property
    def geometry(self) -> Geometry:
        """The canaries' shapes and vectors (built on first use)."""
        if self._geometry is None:
            from opake.auditing._crafted import geometry

            self._geometry = geometry(self.count, self.kind, self.crafted, self.seed)
        return self._geometry

    @property
    def labels(self) -> tuple[str, ...]:
        """Each canary's kind (public: guesses are also made kind by kind)."""
        kinds = self.kinds
        return tuple(kinds[i % len(kinds)] for i in range(self.count))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds in use, in turn: ``(kind, *CRAFTED_KINDS)`` or ``(kind,)``."""
        return (self.kind, *CRAFTED_KINDS) if self.crafted else (self.kind,)

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, K)``: the audit matrix (the audit layer's weight)."""
        g = self.geometry
        return int(g.rows), int(g.columns)

    def directions(self) -> torch.Tensor:
        """The m unit directions ``p qᵀ``, flattened: ``[m, R·K]`` fp32 (dense: for small m)."""
        g = self.geometry
        outer = g.unit_p[:, :, None] * g.unit_q[:, None, :]
        dense: torch.Tensor = outer.reshape(self.count, -1).float()
        return dense

    def examples(
        self, indices: Sequence[int], *, clipping_norm: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples of canaries ``indices``: inputs ``[n, T, K]`` and output gradients
        ``[n, T, R]`` (fp32) of the audit layer, each gradient of norm ``gradient_norm × C``."""
        scale = self.gradient_norm * _positive("clipping_norm", clipping_norm)
        x, y = self.geometry.examples(list(indices), scale)
        return x, y

    def run(
        self,
        included: Sequence[bool] | Any,
        *,
        dataset_size: int,
        clipping_norm: float,
        device: str | torch.device = "cpu",
        engine: str = "auto",
    ) -> CanaryRun:
        """The per-run state: the audit parameter, the canary ``grad_fn`` and the recorded
        scores (``engine``: the clipping engine for the canaries, see :class:`CanaryRun`)."""
        return CanaryRun(
            self,
            included,
            dataset_size=dataset_size,
            clipping_norm=clipping_norm,
            device=device,
            engine=engine,
        )


class CanaryRun:
    """One training run with gradient canaries (made by :meth:`GradientCanaries.run`).

    In the DP-SGD loop: give :attr:`parameter` to the optimizer and ``DPOptimizer`` under
    :data:`CANARY_PARAMETER` (``{**trainable, **run.params}``), draw batches from a sampler
    over :attr:`total_size` indices, :meth:`split` each batch, accumulate the real examples'
    clipped sum *and* :meth:`clipped_sum` of the canary indices (always, even when none was
    drawn), ``step()``, then :meth:`observe`. :meth:`scores` gives each canary's score: the
    inner product of the noisy gradient sums with its direction, in units of C.

    The canaries' clipped sum is computed by ``clipped_grad`` over a
    :class:`~opake.dpsgd.bookkeeping.BatchedLoss` of the audit layer with ``engine=engine``:
    ``"auto"`` (book-keeping, as on a full model), ``"bookkeeping"`` or ``"vmap"``. Pass the
    engine the run's own examples went through in that step —
    ``run.clipped_sum(ids, engine=training.grad_fn.engine)`` — so that the canaries test the
    engine in use; :attr:`engines` counts the engines that actually clipped them.
    """

    def __init__(
        self,
        canaries: GradientCanaries,
        included: Sequence[bool] | Any,
        *,
        dataset_size: int,
        clipping_norm: float,
        device: str | torch.device = "cpu",
        engine: str = "auto",
    ) -> None:
        import numpy as np
        import torch

        from opake.auditing._crafted import SCALES, AuditLayer, canary_losses
        from opake.dpsgd.bookkeeping import BatchedLoss
        from opake.functional import make_functional

        self.canaries = canaries
        truth = np.asarray(included, dtype=bool).reshape(-1)
        if truth.shape != (canaries.count,):
            raise ConfigurationError(
                f"included has {truth.shape[0]} entries for {canaries.count} canaries"
            )
        self.included = truth
        self.dataset_size = _positive_int("dataset_size", dataset_size)
        self.clipping_norm = _positive("clipping_norm", clipping_norm)
        self.engine = _engine(engine)
        scale = canaries.gradient_norm * self.clipping_norm
        low, high = SCALES
        if canaries.crafted and not low <= scale <= high:
            raise ConfigurationError(
                f"gradient_norm × clipping_norm = {scale:g}: the crafted canaries are built for "
                f"{low:g} … {high:g} (their output gradients must stay finite in fp32); use a "
                "clipping norm in that range, or GradientCanaries(crafted=False)"
            )
        self.device = torch.device(device)
        rows, columns = canaries.shape
        layer = AuditLayer(rows, columns).to(self.device)
        fmodel, _ = make_functional(layer)
        self._loss = BatchedLoss(canary_losses(fmodel), fmodel)
        self.parameter = torch.nn.Parameter(
            torch.zeros(rows, columns, dtype=torch.float32, device=self.device)
        )
        geometry = canaries.geometry
        self._p = geometry.unit_p.to(self.device)
        self._q = geometry.unit_q.to(self.device)
        self._grad_fns: dict[str, tuple[Any, Any]] = {}
        #: how many calls of :meth:`clipped_sum` each engine clipped (``grad_fn.engine``)
        self.engines: dict[str, int] = {}
        self._projections: list[torch.Tensor] = []
        self._drawn = np.zeros(canaries.count, dtype=np.int64)

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """``{CANARY_PARAMETER: parameter}``: add it to the optimizer's and DPOptimizer's."""
        return {CANARY_PARAMETER: self.parameter}

    @property
    def total_size(self) -> int:
        """Indices the sampler draws from: the data, then one slot per canary."""
        return self.dataset_size + self.canaries.count

    @property
    def engine_used(self) -> str:
        """The engine(s) that clipped the canaries: ``"bookkeeping"``, ``"vmap"``, or both with
        their call counts (``"bookkeeping (60 calls), vmap (40 calls)"``); ``""`` before any."""
        if len(self.engines) == 1:
            return next(iter(self.engines))
        return ", ".join(f"{name} ({n} calls)" for name, n in sorted(self.engines.items()))

    def split(self, indices: Iterable[int] | Any) -> tuple[list[int], list[int]]:
        """Data indices, and the *included* canaries among the drawn slots.

        A drawn slot of an excluded canary contributes nothing (it is not in the dataset).
        """
        real: list[int] = []
        ids: list[int] = []
        for raw in indices:
            index = int(raw)
            if index < self.dataset_size:
                real.append(index)
                continue
            slot = index - self.dataset_size
            if slot >= self.canaries.count:
                raise OperationError(
                    f"the sampler drew index {index} beyond the {self.total_size} indices of "
                    "data and canaries; build it over run.total_size"
                )
            if self.included[slot]:
                ids.append(slot)
                self._drawn[slot] += 1
        return real, ids

    def _grad_fn(self, engine: str) -> tuple[Any, Any]:
        if engine not in self._grad_fns:
            from opake.auditing._crafted import batch_rows
            from opake.dpsgd.clipping import clipped_grad

            _, chunk = batch_rows(1, self.canaries.shape[1])
            self._grad_fns[engine] = clipped_grad(
                self._loss,
                clipping_norm=self.clipping_norm,
                batch_argnums=(1, 2),
                microbatch_size=chunk,
                check_unused=False,
                engine=engine,
            )
        return self._grad_fns[engine]

    def clipped_sum(self, canary_ids: Sequence[int], *, engine: str | None = None) -> ClippedGrads:
        """The clipped sum of the drawn canaries' gradients (a ``ClippedGrads`` with ``max_norm``
        C), to ``accumulate`` into ``DPOptimizer`` next to the data's.

        ``engine``: the clipping engine for this call (default: the run's); pass the one the
        run's examples went through, ``training.grad_fn.engine``. The canaries are one batch,
        padded with masked rows to the shape whose numerics the crafted canaries target.
        """
        import torch

        from opake.auditing._crafted import batch_rows

        method = self.engine if engine is None else _engine(engine)
        grad_fn, state = self._grad_fn(method)
        ids = [int(i) for i in canary_ids]
        x, y = self.canaries.examples(ids, clipping_norm=self.clipping_norm)
        mask = None
        if ids:
            rows, _ = batch_rows(len(ids), self.canaries.shape[1])
            pad = rows - len(ids)
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
            y = torch.cat([y, y.new_zeros(pad, *y.shape[1:])])
            mask = torch.arange(rows, device=self.device) < len(ids)
        params = {CANARY_PARAMETER: self.parameter.detach()}
        grads, state = grad_fn(
            params, x.to(self.device), y.to(self.device), state=state, example_mask=mask
        )
        self._grad_fns[method] = (grad_fn, state)
        used = str(grad_fn.engine)
        self.engines[used] = self.engines.get(used, 0) + 1
        clipped: ClippedGrads = grads  # built without return_aux: the sum alone
        return clipped

    def observe(self, *, expected_batch_size: float) -> None:
        """Record this step's noisy gradient along every canary direction (after ``step()``).

        ``DPOptimizer`` leaves ``noisy sum / expected_batch_size`` in the parameter's ``.grad``;
        the projection is recorded in units of C.
        """
        grad = self.parameter.grad
        if grad is None:
            raise OperationError(
                "the audit parameter has no .grad after the step: give run.params to the "
                "optimizer and to DPOptimizer, and accumulate run.clipped_sum(...) every step"
            )
        noisy_sum = grad.detach().double() * (expected_batch_size / self.clipping_norm)
        projection = ((self._p @ noisy_sum) * self._q).sum(dim=1)
        self._projections.append(projection.cpu())

    @property
    def steps(self) -> int:
        """Steps observed so far."""
        return len(self._projections)

    def scores(
        self,
        replay: Sequence[Iterable[int]] | None = None,
        *,
        noise_multiplier: float | None = None,
        sample_rate: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Each canary's score, per attack.

        ``"all_steps"``: the sum of its projections over every step (the attack on a secret
        Poisson sampler). With the run's public σ and q, also ``"likelihood_ratio"``: the log
        likelihood ratio of "included" for a Poisson-subsampled Gaussian, ``Σ_t log(1 − q +
        q·exp((x_t − ½)/σ²))`` with ``x_t`` the step's projection in units of C — the most
        powerful test for one canary. With ``replay`` (one batch of indices per step, from a
        sampler rebuilt with a public seed), also ``"replayed_steps"``: the sum over the steps
        whose replayed batch holds the canary's slot — the attack on a sampler whose batches do
        not depend on a secret (with a secret sampler the replay is independent of the run and
        adds nothing).
        """
        import numpy as np
        import torch

        if not self._projections:
            raise OperationError("no step was observed: call run.observe(...) after each step")
        table = torch.stack(self._projections).numpy()  # [T, m]
        out = {"all_steps": table.sum(axis=0)}
        if (noise_multiplier is None) != (sample_rate is None):
            raise ConfigurationError(
                "the likelihood-ratio score needs both noise_multiplier and sample_rate"
            )
        if noise_multiplier is not None and sample_rate is not None:
            from opake.auditing._signal import likelihood_ratio

            sigma = _positive("noise_multiplier", noise_multiplier)
            q = min(1.0, _positive("sample_rate", sample_rate))
            out["likelihood_ratio"] = likelihood_ratio(table, noise_multiplier=sigma, sample_rate=q)
        if replay is not None:
            batches = list(replay)
            if len(batches) != table.shape[0]:
                raise ConfigurationError(
                    f"replay has {len(batches)} batches for {table.shape[0]} observed steps"
                )
            mask = np.zeros_like(table, dtype=bool)
            for t, batch in enumerate(batches):
                for raw in batch:
                    slot = int(raw) - self.dataset_size
                    if 0 <= slot < self.canaries.count:
                        mask[t, slot] = True
            out["replayed_steps"] = np.where(mask, table, 0.0).sum(axis=0)
        return out


@overload
def step_quietly(optimizer: DPTraining) -> StepResult: ...
@overload
def step_quietly(optimizer: DPOptimizer) -> StepReport: ...
def step_quietly(optimizer: Any) -> StepResult | StepReport:
    """``optimizer.step()`` (or ``finish_step()`` of a :class:`~opake.dpsgd.training.DPTraining`),
    without the first-step "all-zero gradient" warning about the audit parameter alone (a step
    that draws no included canary gives it a zero sum, as expected). Every other warning is
    re-issued."""
    import warnings

    finish = getattr(optimizer, "finish_step", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report: StepResult | StepReport = finish() if callable(finish) else optimizer.step()
    for item in caught:
        if not _only_canary_zero(str(item.message)):
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return report


def _only_canary_zero(message: str) -> bool:
    marker = " received an all-zero gradient"
    if marker not in message or "received no gradient entry" in message:
        return False
    names = message.split(marker, maxsplit=1)[0].rsplit(": ", 1)[-1].rsplit("; ", 1)[-1]
    return [n.strip() for n in names.split(",")] == [CANARY_PARAMETER]
