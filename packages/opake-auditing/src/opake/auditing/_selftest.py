"""The self-test: a small DP-SGD run with gradient canaries, on opake-core's mechanism as built.

A linear model trains on synthetic data through :class:`~opake.dpsgd.training.DPTraining`, the
DP step ``opake train`` and ``DPTrainer`` compose (``PoissonSampler`` → ``clipped_grad`` →
``DPOptimizer``, σ calibrated by ``opake.accounting`` for the target ε → the accountant), with
m Dirac canaries as extra dataset slots. With a correct mechanism the lower bound stays
below the claimed ε; a mechanism that skips its noise, its clipping, computes a norm too small
or replaces Poisson sampling by a public batch order is caught at the default settings.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

from opake.auditing._canaries import GradientCanaries, step_quietly
from opake.auditing._onerun import draw_inclusion, one_run_audit
from opake.auditing._result import AuditResult
from opake.core.choices import TRAINING_PLD_OPTIONS

__all__ = ["PLD_OPTIONS", "REPLAY_SEED", "replay_batches", "self_test"]

#: PLD discretisation: pessimistic (ε stays an upper bound) and fast
PLD_OPTIONS = dict(TRAINING_PLD_OPTIONS)

#: seed of the auditor's replay of the sampler: public by design (a sampler whose batches do
#: not depend on its secret seed replays exactly; a correct one replays independent batches)
REPLAY_SEED = 20231210


def replay_batches(dataset_size: int, sample_rate: float, steps: int) -> list[list[int]]:
    """``steps`` batches of ``opake.dpsgd.sampling.PoissonSampler`` rebuilt with the public
    :data:`REPLAY_SEED`: what an auditor can predict about the batches without the secret."""
    from opake.dpsgd import sampling

    stream = _forever(sampling.PoissonSampler(dataset_size, sample_rate, seed=REPLAY_SEED))
    return [[int(i) for i in next(stream)] for _ in range(steps)]


def _forever(sampler: Any) -> Iterator[Any]:
    while True:
        yield from sampler


def self_test(
    *,
    epsilon: float = 2.0,
    delta: float = 1e-5,
    canaries: int = 1000,
    dataset_size: int = 1000,
    sample_rate: float = 0.05,
    steps: int = 100,
    clipping_norm: float = 1.0,
    confidence: float = 0.95,
    seed: int | None = None,
) -> AuditResult:
    """Audit a small DP-SGD run of opake-core's mechanism at ``epsilon``; returns the result.

    Everything random (data, inclusion, sampler, noise) comes from ``seed`` (``None``: OS
    entropy); the auditor's replay uses the public :data:`REPLAY_SEED` only.

    Example:
        >>> result = self_test(canaries=200, steps=20, seed=0)
        >>> result.consistent
        True
    """
    import torch

    from opake import accounting
    from opake.dpsgd.training import DPTraining

    master = secrets.randbits(63) if seed is None else seed
    gen = torch.Generator().manual_seed(master)
    dim = 8
    x = torch.randn(dataset_size, dim, generator=gen)
    y = x @ torch.randn(dim, generator=gen) + 0.1 * torch.randn(dataset_size, generator=gen)
    weights = {"w": torch.nn.Parameter(torch.zeros(dim))}

    def loss_fn(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> Any:
        return (params["w"] @ xi - yi) ** 2

    spec = GradientCanaries(canaries, kind="dirac")
    included = draw_inclusion(canaries, seed=master + 1)
    run = spec.run(included, dataset_size=dataset_size, clipping_norm=clipping_norm)
    sigma = accounting.calibrate_noise(
        target_epsilon=epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant_options=PLD_OPTIONS,
    )
    params = {**weights, **run.params}
    # the DP step as opake train and DPTrainer compose it; the audit parameter is among the
    # tensors its DP optimizer noises and steps, not in the data's gradient function
    training = DPTraining(
        loss_fn,
        torch.optim.SGD(list(params.values()), lr=0.05),
        {"w": weights["w"].detach()},
        module=params,
        batch_args=2,
        dataset_size=run.total_size,
        sample_rate=sample_rate,
        noise_multiplier=sigma,
        delta=delta,
        clipping_norm=clipping_norm,
        accountant=accounting.make_accountant("pld", **PLD_OPTIONS),
        seed=master + 2,
    )
    batches = training.batches()
    for _ in range(steps):
        real, ids = run.split(next(batches))
        index = torch.as_tensor(real, dtype=torch.long)
        training.accumulate(x[index], y[index])
        training.optimizer.accumulate(run.clipped_sum(ids))
        step_quietly(training)
        run.observe(expected_batch_size=training.expected_batch_size)
    replay = replay_batches(run.total_size, sample_rate, steps)
    claimed = training.epsilon()
    return one_run_audit(
        run.scores(replay, noise_multiplier=sigma, sample_rate=sample_rate),
        included,
        claimed_epsilon=claimed,
        delta=delta,
        confidence=confidence,
        kind="gradient",
    )
