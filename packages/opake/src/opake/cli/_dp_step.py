"""The DP step of ``opake train``, composed once: one :class:`~opake.dpsgd.training.DPTraining`
construction for the whole model (:mod:`opake.cli._trainer`) and for the model sharded layer by
layer (:mod:`opake.cli._shard`, which adds ``shard=True``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from opake.cli._plan import RunPlan
    from opake.dpsgd.training import DPTraining

__all__ = ["dp_training"]


def dp_training(
    plan: RunPlan,
    loss: Any,
    inner: torch.optim.Optimizer,
    trainable: Mapping[str, torch.Tensor],
    *,
    module: Any,
    microbatch_size: int | None,
    **own: Any,
) -> DPTraining:
    """The DP step of the run: the sampler (every rank draws the global batch and keeps its
    share), the clipped-gradient function, the DP optimizer (the divisor q·N, noise once; under
    torchrun the clipped sums of every rank all-reduced before the noise) and the accountant.

    Secure (default): batch membership and noise from a key drawn on rank 0 and shared, never
    stored; ``--reproducible``: from ``--seed`` (not private). What every run shares is decided
    here (the data size, the seed, :meth:`~opake.cli._plan.RunPlan.training_options`); *own* is
    what the run adds (the unsharded run's frozen parameters, sampler and privacy units;
    ``--shard``'s ``shard=True``).
    """
    from opake.dpsgd.training import DPTraining

    s = plan.settings
    return DPTraining(
        loss,
        inner,
        trainable,
        module=module,
        dataset_size=plan.dataset_size,
        microbatch_size=microbatch_size,
        seed=s.seed if s.reproducible else None,
        **own,
        **plan.training_options(),
    )
