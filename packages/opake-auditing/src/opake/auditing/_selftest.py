"""The self-test: a small DP-SGD run with gradient canaries, on opake-core's mechanism as built.

A small sequence model (an embedding and a linear layer over 8 tokens) trains on synthetic data
through :class:`~opake.dpsgd.training.DPTraining`, the DP step ``opake train`` and ``DPTrainer``
compose (``PoissonSampler`` → ``clipped_grad`` over a
:class:`~opake.dpsgd.bookkeeping.BatchedLoss` → ``DPOptimizer``, σ calibrated by
``opake.accounting`` for the target ε → the accountant), with m gradient canaries as extra
dataset slots. The clipping engine is the one such a run uses — book-keeping on a full model
(``engine="auto"``) — or the one named; the canaries go through the engine the data went
through in each step, a quarter of them plain (Dirac) and a quarter of each kind crafted
against book-keeping's numerics (:class:`~opake.auditing.GradientCanaries`). With a correct
mechanism the lower bound stays below the claimed ε; a mechanism that skips its noise, its
clipping, computes a norm too small, trusts a Gram norm that rounding made small, or replaces
Poisson sampling by a public batch order is caught at the default settings.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

from opake.auditing._canaries import GradientCanaries, step_quietly
from opake.auditing._onerun import draw_inclusion, one_run_audit
from opake.auditing._result import AuditResult
from opake.core.choices import ENGINES, TRAINING_PLD_OPTIONS
from opake.core.errors import ConfigurationError

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


_VOCAB, _STEPS, _WIDTH = 32, 8, 8  # the self-test's sequence model: tokens, length, width


def _data(dataset_size: int, gen: Any) -> tuple[Any, Any, Any]:
    """Token sequences, their per-token targets, and the model (embedding + linear), all
    drawn from ``gen``."""
    import torch

    ids = torch.randint(0, _VOCAB, (dataset_size, _STEPS), generator=gen)
    table = torch.randn(_VOCAB, generator=gen)
    targets = table[ids] + 0.1 * torch.randn(dataset_size, _STEPS, generator=gen)
    model = torch.nn.Sequential(torch.nn.Embedding(_VOCAB, _WIDTH), torch.nn.Linear(_WIDTH, 1))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return ids, targets, model


def _train(training: Any, run: Any, ids: Any, targets: Any, steps: int) -> dict[str, int]:
    """``steps`` DP steps, the drawn included canaries' clipped sum — by the engine the data
    just went through — in each; returns how many steps each engine clipped the data."""
    import torch

    engines: dict[str, int] = {}
    batches = training.batches()
    for _ in range(steps):
        real, drawn = run.split(next(batches))
        index = torch.as_tensor(real, dtype=torch.long)
        training.accumulate(ids[index], targets[index])
        used = str(training.grad_fn.engine)
        engines[used] = engines.get(used, 0) + 1
        training.optimizer.accumulate(run.clipped_sum(drawn, engine=used))
        step_quietly(training)
        run.observe(expected_batch_size=training.expected_batch_size)
    return engines


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
    engine: str = "auto",
    crafted: bool = True,
    seed: int | None = None,
) -> AuditResult:
    """Audit a small DP-SGD run of opake-core's mechanism at ``epsilon``; returns the result.

    ``engine`` is the clipping engine (``clipped_grad(engine=...)``): ``"auto"`` (default) is
    what ``opake train`` uses on a full model — book-keeping here; ``"vmap"`` audits the vmap
    engine. The canaries go through the engine the data went through in each step; with
    ``crafted`` (default) their kinds include those crafted against book-keeping's numerics.
    ``result.engine`` names the engine that clipped the canaries, ``result.extra["engine_steps"]``
    counts the steps of each engine for the data and the canaries; ``noise_multiplier``,
    ``sample_rate`` and ``steps`` in ``result.extra`` are the run's σ, q and T (for
    :class:`SubsampledGaussian`, the mechanism its canaries went through).

    Everything random (data, inclusion, sampler, noise) comes from ``seed`` (``None``: OS
    entropy); the auditor's replay uses the public :data:`REPLAY_SEED` only.

    Example:
        >>> result = self_test(canaries=200, steps=20, seed=0)
        >>> result.consistent, result.engine
        (True, 'bookkeeping')
    """
    import torch

    from opake import accounting
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    if engine not in ENGINES:
        raise ConfigurationError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
    master = secrets.randbits(63) if seed is None else seed
    gen = torch.Generator().manual_seed(master)
    ids, targets, model = _data(dataset_size, gen)
    fmodel, trainable = make_functional(model)

    def losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example losses ``[B]``: each example's mean squared error over its tokens."""
        out: torch.Tensor = ((fmodel(params, x)[..., 0] - y) ** 2).mean(dim=1)
        return out

    spec = GradientCanaries(canaries, kind="dirac", crafted=crafted, seed=master + 3)
    included = draw_inclusion(canaries, seed=master + 1)
    run = spec.run(included, dataset_size=dataset_size, clipping_norm=clipping_norm)
    sigma = accounting.calibrate_noise(
        target_epsilon=epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant_options=PLD_OPTIONS,
    )
    optimizer = torch.optim.SGD([*model.parameters(), run.parameter], lr=0.05)
    # the DP step as opake train and DPTrainer compose it; the audit parameter is among the
    # tensors its DP optimizer noises and steps, not in the data's gradient function
    training = DPTraining(
        BatchedLoss(losses, fmodel),
        optimizer,
        trainable,
        module={**trainable, **run.params},
        batch_args=2,
        dataset_size=run.total_size,
        sample_rate=sample_rate,
        noise_multiplier=sigma,
        delta=delta,
        clipping_norm=clipping_norm,
        engine=engine,
        accountant=accounting.make_accountant("pld", **PLD_OPTIONS),
        seed=master + 2,
    )
    data_engines = _train(training, run, ids, targets, steps)
    replay = replay_batches(run.total_size, sample_rate, steps)
    result = one_run_audit(
        run.scores(replay, noise_multiplier=sigma, sample_rate=sample_rate),
        included,
        claimed_epsilon=training.epsilon(),
        delta=delta,
        confidence=confidence,
        kind="gradient",
        groups=spec.labels,
        engine=run.engine_used,
    )
    result.extra.update(
        engine_steps={"data": data_engines, "canaries": dict(run.engines)},
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        steps=steps,
    )
    return result
