"""Data-side helpers of the samplers: the padding mask, the padded dataset, empty batches."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch
from opake.dpsgd.sampling._base import PADDING_INDEX, _int

__all__ = ["EmptyBatchCollate", "PaddedDataset", "padding_mask"]


def padding_mask(batch: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Bool tensor: True for real examples, False for :data:`PADDING_INDEX` slots.

    Example:
        >>> padding_mask([4, 9, PADDING_INDEX]).tolist()
        [True, True, False]
    """
    import torch

    indices = torch.as_tensor(batch, dtype=torch.int64)
    return indices != PADDING_INDEX


class PaddedDataset:
    """Map-style dataset wrapper for :class:`FixedShapePoissonSampler`: ``(example, is_real)``.

    ``dataset[i]`` becomes ``(dataset[i], True)``; the padding index becomes
    ``(dataset[filler_index], False)`` — a real example used only for its shape, whose
    contribution the training step must mask to zero. The default collate then yields
    ``(batch, mask)`` with ``mask`` a bool tensor of shape ``(slots,)``.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from opake.dpsgd.sampling import FixedShapePoissonSampler
        >>> data = TensorDataset(torch.arange(10.0))
        >>> sampler = FixedShapePoissonSampler(10, 0.2, max_batch_size=6, seed=1)
        >>> (x,), mask = next(iter(DataLoader(PaddedDataset(data), batch_sampler=sampler)))
        >>> x.shape, mask.tolist()
        (torch.Size([6]), [True, True, False, False, False, False])
    """

    def __init__(self, dataset: Any, filler_index: int = 0) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise InputTypeError(
                f"dataset={type(dataset).__name__}: expected a map-style dataset (__getitem__)"
            )
        self.dataset = dataset
        self.filler_index = _int("filler_index", filler_index, minimum=0)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, bool]:
        if index == PADDING_INDEX:
            return self.dataset[self.filler_index], False
        if index < 0:
            raise ConfigurationError(
                f"index {index}: negative indices other than PADDING_INDEX={PADDING_INDEX} "
                "are not dataset positions"
            )
        return self.dataset[index], True


class EmptyBatchCollate:
    """A collate function that also handles the empty batches Poisson sampling produces.

    Non-empty batches go to ``collate_fn`` (default: torch's ``default_collate``). An empty
    batch returns the collated structure of one example (``dataset[0]``) with every tensor cut
    to length 0 along the batch dimension, so ``x.shape == (0, *example_shape)`` flows through
    the model and ``clipped_grad`` returns zero gradients (the step still adds noise).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long))
        >>> x, y = EmptyBatchCollate(data)([])
        >>> tuple(x.shape), tuple(y.shape), y.dtype
        ((0, 3), (0,), torch.int64)
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise InputTypeError(
                f"dataset={type(dataset).__name__}: expected a map-style dataset (__getitem__)"
            )
        if collate_fn is not None and not callable(collate_fn):
            raise InputTypeError(f"collate_fn={collate_fn!r}: expected a callable")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self._template: Any = None

    def _collate(self, batch: list[Any]) -> Any:  # Any: what collate_fn returns
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        from torch.utils.data import default_collate

        return default_collate(batch)

    def __call__(self, batch: list[Any]) -> Any:  # Any: the batch as collate_fn builds it
        if len(batch):
            return self._collate(batch)
        if self._template is None:
            if len(self.dataset) == 0:
                raise ConfigurationError("an empty dataset has no example to shape empty batches")
            self._template = self._collate([self.dataset[0]])
        return _emptied(self._template)


def _emptied(value: object) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return value[:0].clone()
    if isinstance(value, Mapping):
        # collated mappings are dict-like classes built from a dict (dict, OrderedDict, ...);
        # the Mapping protocol itself says nothing about constructors
        rebuild = cast("Callable[[dict[object, object]], object]", type(value))
        return rebuild({k: _emptied(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        fields = cast("Callable[..., object]", type(value))  # a namedtuple: one arg per field
        return fields(*(_emptied(v) for v in value))
    if isinstance(value, tuple | list):
        # A list of collated fields (tensors, dicts, …) keeps its structure; a list of plain
        # values (strings, ids) is itself the batch, so it becomes empty.
        if value and all(isinstance(v, torch.Tensor | Mapping | tuple | list) for v in value):
            return type(value)(_emptied(v) for v in value)
        return type(value)()
    return value
