"""``DPTraining``'s read-only views of its components (a base class: the step lives in
:mod:`._dp_training`, persistence reads these views in :mod:`._persist`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from opake.accounting import PrivacyAccountant
    from opake.dpsgd.clipping import ClippedGradFn, ClipState
    from opake.dpsgd.distributed import DistributedContext, DistributedDPOptimizer
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, UnitPoissonSampler
    from opake.dpsgd.training._budget import Spending

__all__ = ["TrainingViews"]


class TrainingViews:
    """Read-only views of a :class:`~opake.dpsgd.training.DPTraining`'s components."""

    _sampler: PoissonSampler | FixedShapePoissonSampler | UnitPoissonSampler
    _optimizer: DistributedDPOptimizer
    _grad_fn: ClippedGradFn
    _accountant: PrivacyAccountant
    _clip_state: ClipState
    _delta: float
    _spending: Spending
    _secure: bool
    _context: DistributedContext
    _pending_aux: list[Any]
    _shard: torch.nn.Module | None

    @property
    def sharded_module(self) -> torch.nn.Module | None:
        """The ``fully_shard``-ed module with ``shard=True`` (per-layer sharded compute), else
        ``None``."""
        return self._shard

    @property
    def pending_batches(self) -> int:
        """Physical batches accumulated into the step in progress."""
        return len(self._pending_aux)

    @property
    def sampler(self) -> PoissonSampler | FixedShapePoissonSampler | UnitPoissonSampler:
        """The Poisson sampler (this rank's shard of the global batches; of units with
        ``privacy_units``)."""
        return self._sampler

    @property
    def optimizer(self) -> DistributedDPOptimizer:
        """The DP optimizer (a ``DistributedDPOptimizer``, a plain one in a single process)."""
        return self._optimizer

    @property
    def grad_fn(self) -> ClippedGradFn:
        """The clipped-gradient function (``grad_fn.engine`` names the engine it took)."""
        return self._grad_fn

    @property
    def accountant(self) -> PrivacyAccountant:
        """The accountant every logical step is recorded in."""
        return self._accountant

    @property
    def clip_state(self) -> ClipState:
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
        """What Poisson sampling draws from: the examples, or with ``privacy_units`` the units
        (the accountant's N; the records are ``sampler.record_count``)."""
        return int(self._sampler.dataset_size)

    @property
    def privacy_unit(self) -> str:
        """What ε protects: ``"example"``, or ``"unit"`` with ``privacy_units`` (all of a
        unit's records together)."""
        return "unit" if getattr(self._sampler, "_kind", None) == "unit_poisson" else "example"

    @property
    def delta(self) -> float:
        return self._delta

    @property
    def target_epsilon(self) -> float | None:
        return self._spending.budget.target

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

    @property
    def process_group(self) -> ProcessGroup | None:
        """The ``torch.distributed`` group the ranks reduce over (``None``: the default group,
        or one process)."""
        group: ProcessGroup | None = self._context.group  # DistributedContext holds it untyped
        return group

    def __repr__(self) -> str:
        return (
            f"DPTraining(steps={self.steps}, σ={self.noise_multiplier:.4g}, "
            f"q={self.sample_rate:.4g}, N={self.dataset_size}, δ={self._delta:.3g}, "
            f"target_epsilon={self.target_epsilon}, world_size={self.world_size}, "
            f"{'sharded, ' if self._shard is not None else ''}"
            f"{'secure' if self._secure else 'seeded'})"
        )
