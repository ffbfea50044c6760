"""Input (black-box) canaries: examples inserted into the training data when included, such as
random-token sequences."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opake.auditing._canaries import _positive_int
from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["InputCanaries", "random_token_canaries"]


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
