"""``audit``: run a user's own training function with canaries and bound its ε."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake.auditing._canaries import CanaryRun, GradientCanaries
from opake.auditing._input import InputCanaries
from opake.auditing._onerun import draw_inclusion, one_run_audit
from opake.auditing._result import AuditResult
from opake.auditing._signal import SubsampledGaussian
from opake.core.errors import ConfigurationError, InputTypeError

__all__ = ["audit"]


def audit(
    train: Callable[[Any], Any],
    canaries: GradientCanaries | InputCanaries,
    *,
    claimed_epsilon: float | Callable[[Any], float],
    delta: float,
    score: Callable[[Any, Any], Any] | None = None,
    confidence: float = 0.95,
    guesses: int | tuple[int, int] | None = None,
    seed: int | None = None,
    mechanism: SubsampledGaussian | None = None,
    **unknown: Any,
) -> AuditResult:
    """Audit one training run of ``train`` with canaries; return the claimed vs measured ε.

    Each canary is included independently with probability ½ (OS entropy unless ``seed``).

    - **Gradient canaries** (white-box): ``train(setup)`` receives a callable
      ``setup(dataset_size=N, clipping_norm=C, device="cpu", engine="auto")`` that returns a
      :class:`CanaryRun`; the training loop uses it as :class:`CanaryRun` describes (its
      parameter in the optimizer, a sampler over ``run.total_size``, ``run.split``,
      ``run.clipped_sum(ids, engine=training.grad_fn.engine)`` — the canaries through the
      engine the run's own examples went through — and ``run.observe``). Scores come from the
      recorded noisy gradients, guessed over all canaries and kind by kind
      (:attr:`GradientCanaries.labels`); ``train`` may return a list of replayed batches (see
      :meth:`CanaryRun.scores`) or ``None``. ``result.engine`` names the engine(s) that
      clipped the canaries.
    - **Input canaries** (black-box): ``train(examples)`` receives the included canaries'
      examples (to add to its data) and returns whatever ``score(returned, all_examples)``
      needs to give one score per canary (higher = more likely trained on), e.g. the loss
      reduction from the initial model.

    ``claimed_epsilon`` is a number, or a callable of what ``train`` returned (e.g. reading its
    accountant). ``mechanism`` (the run's σ, q and T as a :class:`SubsampledGaussian`) adds
    what a run that exactly meets the claim is expected to show (see
    :func:`~opake.auditing.one_run_audit`).

    Example:
        >>> import numpy as np
        >>> import torch
        >>> canaries = InputCanaries(torch.arange(200.0))
        >>> def train(examples):  # a "mechanism" that publishes its data exactly: no privacy
        ...     return set(examples.tolist())
        >>> def score(trained, examples):
        ...     return np.array([float(x in trained) for x in examples.tolist()])
        >>> result = audit(train, canaries, claimed_epsilon=1.0, delta=1e-5, score=score, seed=0)
        >>> result.consistent
        False
    """
    if unknown:
        raise ConfigurationError(
            f"audit() got unknown keyword argument(s) {sorted(unknown)}; accepted: "
            "claimed_epsilon, delta, score, confidence, guesses, seed, mechanism"
        )
    if not callable(train):
        raise InputTypeError(f"train={train!r}: expected a callable that trains one model")
    included = draw_inclusion(len(canaries), seed=seed)
    if isinstance(canaries, GradientCanaries):
        if score is not None:
            raise ConfigurationError(
                "score= with gradient canaries: they are scored from the recorded noisy "
                "gradients; drop score="
            )
        runs: list[CanaryRun] = []

        def setup(
            *, dataset_size: int, clipping_norm: float, device: Any = "cpu", engine: str = "auto"
        ) -> CanaryRun:
            if runs:
                raise ConfigurationError("setup() called twice: one audit audits one run")
            runs.append(
                canaries.run(
                    included,
                    dataset_size=dataset_size,
                    clipping_norm=clipping_norm,
                    device=device,
                    engine=engine,
                )
            )
            return runs[0]

        returned = train(setup)
        if not runs:
            raise ConfigurationError(
                "train() never called setup(dataset_size=, clipping_norm=): the canaries were "
                "not injected"
            )
        replay = returned if isinstance(returned, list) else None
        scores: Any = runs[0].scores(replay)
        groups: Any = canaries.labels
        engine: str | None = runs[0].engine_used or None
    elif isinstance(canaries, InputCanaries):
        if score is None:
            raise ConfigurationError(
                "input canaries need score=: a callable (trained, examples) -> one score per "
                "canary (e.g. loss before training minus loss after)"
            )
        returned = train(canaries.included_examples(included))
        scores = score(returned, canaries.examples)
        groups, engine = None, None
    else:
        raise InputTypeError(
            f"canaries={type(canaries).__name__}: expected GradientCanaries or InputCanaries"
        )
    return one_run_audit(
        scores,
        included,
        claimed_epsilon=claimed_epsilon(returned) if callable(claimed_epsilon) else claimed_epsilon,
        delta=delta,
        confidence=confidence,
        guesses=guesses,
        kind=canaries.kind_name,
        groups=groups,
        engine=engine,
        mechanism=mechanism,
    )
