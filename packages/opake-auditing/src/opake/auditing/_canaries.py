"""Canaries: gradient (white-box) directions injected through the DP optimizer, and input
(black-box) examples such as random-token sequences."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "CANARY_PARAMETER",
    "CanaryRun",
    "GradientCanaries",
    "InputCanaries",
    "random_token_canaries",
    "step_quietly",
]

#: name of the audit parameter (a flat fp32 vector the model never reads) in the dicts given
#: to the optimizer and to ``DPOptimizer``
CANARY_PARAMETER = "opake_audit.canaries"
KINDS = ("dirac", "random")


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


class GradientCanaries:
    """White-box canaries: each is a fixed unit direction injected as one example's gradient.

    The directions live in a dedicated trainable vector (:data:`CANARY_PARAMETER`) that the
    model never reads, so the data's own gradients do not blur them. A canary "example" has
    the loss ``gradient_norm × C × ⟨θ_audit, u⟩``: its gradient is ``gradient_norm × C × u``,
    far beyond the clipping bound C, and it goes through the real ``clipped_grad`` (clipping),
    the sampler (canary i is dataset index ``dataset_size + i``), ``DPOptimizer`` (noise once,
    division by the expected batch) and the accountant — the mechanism as built.

    Args:
        count: m, the number of canaries.
        kind: ``"dirac"`` (canary i is coordinate i of the audit vector) or ``"random"``
            (random unit directions in a vector of ``dimension`` coordinates).
        dimension: size of the audit vector for ``"random"`` (default ``max(4·m, 1024)``).
        gradient_norm: the canary gradient's norm as a multiple of C (default 100: a clipping
            fault lets it through at up to this many times C).
        seed: seed of the random directions (``None``: OS entropy). Not a secret: the auditor
            knows the directions.

    Example:
        >>> canaries = GradientCanaries(4)
        >>> canaries.directions().shape
        torch.Size([4, 4])
    """

    kind_name = "gradient"

    def __init__(
        self,
        count: int = 1000,
        *,
        kind: str = "dirac",
        dimension: int | None = None,
        gradient_norm: float = 100.0,
        seed: int | None = None,
    ) -> None:
        self.count = _positive_int("count", count)
        if kind not in KINDS:
            raise ConfigurationError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
        self.kind = kind
        if kind == "dirac":
            if dimension is not None and dimension != count:
                raise ConfigurationError(
                    f"dimension={dimension} with kind='dirac': a Dirac canary is one coordinate, "
                    "so the audit vector has exactly `count` coordinates; drop dimension"
                )
            self.dimension = count
        else:
            self.dimension = (
                max(4 * count, 1024) if dimension is None else _positive_int("dimension", dimension)
            )
        self.gradient_norm = _positive("gradient_norm", gradient_norm)
        self.seed = secrets.randbits(63) if seed is None else seed

    def __len__(self) -> int:
        return self.count

    def directions(self) -> torch.Tensor:
        """The m unit directions, ``[m, dimension]`` fp32."""
        import torch

        if self.kind == "dirac":
            return torch.eye(self.count, dtype=torch.float32)
        gen = torch.Generator().manual_seed(self.seed)
        u = torch.randn(self.count, self.dimension, generator=gen, dtype=torch.float64)
        unit: torch.Tensor = (u / u.norm(dim=1, keepdim=True)).float()
        return unit

    def run(
        self,
        included: Sequence[bool] | Any,
        *,
        dataset_size: int,
        clipping_norm: float,
        device: str | torch.device = "cpu",
    ) -> CanaryRun:
        """The per-run state: the audit parameter, the canary grad_fn and the recorded scores."""
        return CanaryRun(
            self,
            included,
            dataset_size=dataset_size,
            clipping_norm=clipping_norm,
            device=device,
        )


class CanaryRun:
    """One training run with gradient canaries (made by :meth:`GradientCanaries.run`).

    In the DP-SGD loop: give :attr:`parameter` to the optimizer and ``DPOptimizer`` under
    :data:`CANARY_PARAMETER` (``{**trainable, **run.params}``), draw batches from a sampler
    over :attr:`total_size` indices, :meth:`split` each batch, accumulate the real examples'
    clipped sum *and* :meth:`clipped_sum` of the canary indices (always, even when none was
    drawn), ``step()``, then :meth:`observe`. :meth:`scores` gives each canary's score: the
    inner product of the noisy gradient sums with its direction, in units of C.
    """

    def __init__(
        self,
        canaries: GradientCanaries,
        included: Sequence[bool] | Any,
        *,
        dataset_size: int,
        clipping_norm: float,
        device: str | torch.device = "cpu",
    ) -> None:
        import numpy as np
        import torch

        from opake.dpsgd.clipping import clipped_grad

        self.canaries = canaries
        truth = np.asarray(included, dtype=bool).reshape(-1)
        if truth.shape != (canaries.count,):
            raise ConfigurationError(
                f"included has {truth.shape[0]} entries for {canaries.count} canaries"
            )
        self.included = truth
        self.dataset_size = _positive_int("dataset_size", dataset_size)
        self.clipping_norm = _positive("clipping_norm", clipping_norm)
        self.device = torch.device(device)
        self.parameter = torch.nn.Parameter(
            torch.zeros(canaries.dimension, dtype=torch.float32, device=self.device)
        )
        self._u = canaries.directions().to(self.device)
        scale = canaries.gradient_norm * self.clipping_norm

        def canary_loss(params: dict[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
            """One canary example: a linear loss whose gradient is ``scale · u``."""
            return scale * torch.dot(params[CANARY_PARAMETER], u)

        self._grad_fn, self._state = clipped_grad(
            canary_loss,
            argnums=0,
            clipping_norm=self.clipping_norm,
            batch_argnums=1,
            method="vmap",
            check_unused=False,
        )
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

    def clipped_sum(self, canary_ids: Sequence[int]) -> Any:
        """The clipped sum of the drawn canaries' gradients (a ``ClippedGrads`` with ``max_norm``
        C), to ``accumulate`` into ``DPOptimizer`` next to the data's."""
        import torch

        index = torch.as_tensor(list(canary_ids), dtype=torch.long, device=self.device)
        grads, self._state = self._grad_fn(
            {CANARY_PARAMETER: self.parameter.detach()}, self._u[index], state=self._state
        )
        return grads

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
        self._projections.append((self._u.double() @ noisy_sum).cpu())

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
            sigma = _positive("noise_multiplier", noise_multiplier)
            q = _positive("sample_rate", sample_rate)
            if q >= 1.0:
                out["likelihood_ratio"] = ((table - 0.5) / sigma**2).sum(axis=0)
            else:
                log_in = math.log(q) + (table - 0.5) / sigma**2
                out["likelihood_ratio"] = np.logaddexp(math.log1p(-q), log_in).sum(axis=0)
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


class InputCanaries:
    """Black-box canaries: m examples inserted into the training data when included.

    Score them with the trained model, e.g. the loss reduction from the initial model
    (``loss_before − loss_after``: a memorised canary's loss drops most).

    Args:
        examples: a tensor whose first dimension is m (one canary example per row).

    Example:
        >>> canaries = random_token_canaries(3, length=5, vocab_size=10, seed=0)
        >>> len(canaries), tuple(canaries.examples.shape)
        (3, (3, 5))
    """

    kind_name = "input"

    def __init__(self, examples: torch.Tensor) -> None:
        import torch

        if not isinstance(examples, torch.Tensor) or examples.dim() < 1 or not len(examples):
            raise InputTypeError(
                "examples: expected a tensor with one canary example per row (first dimension m)"
            )
        self.examples = examples
        self.count = int(examples.shape[0])

    def __len__(self) -> int:
        return self.count

    def included_examples(self, included: Sequence[bool] | Any) -> torch.Tensor:
        """The rows of the included canaries (to add to the training data)."""
        import numpy as np
        import torch

        truth = np.asarray(included, dtype=bool).reshape(-1)
        if truth.shape != (self.count,):
            raise ConfigurationError(f"included has {truth.shape[0]} entries for {self.count}")
        return self.examples[torch.as_tensor(truth)]


def random_token_canaries(
    count: int, *, length: int, vocab_size: int, seed: int | None = None, low: int = 0
) -> InputCanaries:
    """m sequences of ``length`` tokens drawn uniformly from ``[low, vocab_size)``.

    Random sequences are far from natural text, so whether the model has seen one shows in
    its loss. ``seed=None`` draws from OS entropy.
    """
    import torch

    _positive_int("count", count)
    _positive_int("length", length)
    _positive_int("vocab_size", vocab_size)
    if not 0 <= low < vocab_size:
        raise ConfigurationError(f"low={low!r}: expected 0 <= low < vocab_size ({vocab_size})")
    gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    return InputCanaries(torch.randint(low, vocab_size, (count, length), generator=gen))


def step_quietly(optimizer: Any) -> Any:
    """``optimizer.step()`` (or ``finish_step()`` of a :class:`~opake.dpsgd.training.DPTraining`),
    without the first-step "all-zero gradient" warning about the audit parameter alone (a step
    that draws no included canary gives it a zero sum, as expected). Every other warning is
    re-issued."""
    import warnings

    finish = getattr(optimizer, "finish_step", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = finish() if callable(finish) else optimizer.step()
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
