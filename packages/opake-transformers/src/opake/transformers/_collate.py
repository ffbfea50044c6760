"""Collation and batch sampling for DP training with the Hugging Face Trainer.

- :class:`DPDataCollator` pads each example on its own (right padding; labels ``-100`` on
  padding; a base collator's left padding is moved to the right, :func:`right_aligned`) and
  turns the 2-D attention mask into something both per-example engines accept: nothing at all
  for a right-padded causal LM (the padding comes after every real token and carries no label,
  so it cannot influence them), a 4-D float additive mask otherwise (0 = attend, the dtype's
  minimum = masked; a 2-D mask fails under ``vmap`` and a 4-D bool mask is misread by eager
  attention).
- :class:`PoissonBatches` is the ``batch_sampler``: each logical step's Poisson batch (this
  rank's shard) split into ``gradient_accumulation_steps`` physical batches, empty ones included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.transformers._rows import check_alone, check_rows

if TYPE_CHECKING:
    import torch

__all__ = ["DPDataCollator", "PoissonBatches", "engine_mask", "right_aligned"]

_PAD_ZERO = ("attention_mask", "token_type_ids", "special_tokens_mask")


def _pad(rows: list[Any], value: int) -> torch.Tensor:
    import torch

    tensors = [torch.as_tensor(r) for r in rows]
    if all(t.dim() == 0 for t in tensors):
        return torch.stack(tensors)
    length = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), length, *tensors[0].shape[1:]), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


def engine_mask(mask: torch.Tensor, *, causal: bool, dtype: Any = None) -> torch.Tensor | None:
    """The mask to pass instead of a 2-D ``attention_mask`` (``None``: pass none).

    Right-padded causal LM: ``None`` (exact, see the module docstring). Otherwise a float
    additive mask: ``[B, 1, 1, T]`` for bidirectional models, ``[B, 1, T, T]`` with the causal
    triangle for causal ones (left padding).

    >>> import torch
    >>> engine_mask(torch.tensor([[1, 1, 0]]), causal=True) is None
    True
    >>> additive = engine_mask(torch.tensor([[1, 1, 0]]), causal=False)
    >>> tuple(additive.shape), float(additive[0, 0, 0, 1]), float(additive[0, 0, 0, 2]) < -1e38
    ((1, 1, 1, 3), 0.0, True)
    """
    import torch

    if mask.dim() != 2:
        return mask  # already 4-D (the caller's own): passed through
    keep = mask.bool()
    right_padded = bool((keep[:, 1:] <= keep[:, :-1]).all()) if keep.shape[1] > 1 else True
    if causal and right_padded:
        return None
    dtype = dtype or torch.float32
    low = torch.finfo(dtype).min
    if not causal:
        additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, low)
        return additive[:, None, None, :]
    length = keep.shape[1]
    triangle = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = triangle[None] & keep[:, None, :]
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, low)
    return additive[:, None]


def right_aligned(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with every row's tokens moved to the front (right padding), when a collator
    padded some rows on the left.

    Without it a left-padded record's tokens sit at positions set by the longest record of its
    batch (a model's position ids run over the padded row), so one record would change every
    other record's gradient (a review measured 6·C with absolute position embeddings). Each row
    is rotated by its number of leading padding tokens, every per-token tensor (``[B, T, ...]``
    with the mask's ``T``) alike: the real tokens then start at position 0 whatever else is in
    the batch. A mask whose kept tokens are not one run per row is refused.

    >>> import torch
    >>> batch = right_aligned({"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
    ...                        "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    ([[5, 6, 0], [7, 8, 9]], [[1, 1, 0], [1, 1, 1]])
    """
    import torch

    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return batch
    keep = mask.bool()
    if bool((keep[:, 1:] <= keep[:, :-1]).all()):
        return batch  # already right-padded
    rows, width = keep.shape
    lead = (~keep).int().cumprod(dim=1).sum(dim=1)  # leading padding tokens per row
    runs = keep.int().diff(dim=1).clamp(min=0).sum(dim=1) + keep[:, 0].int()
    if bool((runs > 1).any()):
        raise ConfigurationError(
            "DPDataCollator: the attention mask has rows whose tokens are not one contiguous "
            "run (padding between tokens); their positions could not be made independent of "
            "the other records in the batch. Pad each record on one side only"
        )
    index = (torch.arange(width)[None, :] + lead[:, None]) % width
    out = dict(batch)
    for key, value in batch.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and value.shape[:2] == (rows, width)
        ):
            shaped = index.reshape(rows, width, *([1] * (value.dim() - 2))).expand_as(value)
            out[key] = value.gather(1, shaped.to(value.device))
    if isinstance(out.get("position_ids"), torch.Tensor):  # positions from the record alone
        moved = out["attention_mask"].long()
        out["position_ids"] = (moved.cumsum(dim=1) - 1).clamp(min=0).to(out["position_ids"])
    return out


def _with_mask(batch: dict[str, Any], features: list[Any]) -> dict[str, Any]:
    """A user collator's ``batch`` with the attention mask of its records when it returned
    none: each row must start with its record's ``input_ids`` (right padding), else refused —
    unmasked padding would make the longest record set every other record's positions and
    padded targets (a review measured 4.5·C with left padding)."""
    import torch

    ids = batch.get("input_ids")
    mask = batch.get("attention_mask")
    if (isinstance(mask, torch.Tensor) and mask.dim() == 2) or not isinstance(ids, torch.Tensor):
        return batch
    if ids.dim() != 2 or not all(isinstance(f, Mapping) and "input_ids" in f for f in features):
        return batch
    width = int(ids.shape[1])
    lengths = [len(f["input_ids"]) for f in features]
    for row, (feature, length) in enumerate(zip(features, lengths, strict=True)):
        own = torch.as_tensor(feature["input_ids"]).to(ids)
        if length > width or not torch.equal(ids[row, :length], own.reshape(-1)):
            raise ConfigurationError(
                f"the data collator returned no attention_mask, and row {row} of input_ids does "
                "not start with its record's tokens (padding on the left?): DPTrainer could not "
                "tell padding from tokens, and the longest record would set every other "
                "record's positions. Return an attention_mask, or pad on the right"
            )
    if all(length == width for length in lengths):
        return batch
    batch["attention_mask"] = _length_mask(lengths, width).to(ids.device)
    return batch


def _length_mask(lengths: list[int], width: int) -> Any:
    """``[len(lengths), width]`` long mask: 1 on each row's first ``lengths[i]`` positions."""
    import torch

    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


class DPDataCollator:
    """Pad a list of examples into a batch that no example can influence through another.

    Args:
        pad_token_id: id used to pad ``input_ids`` (labels are padded with -100).
        causal: the model is a causal LM: ``labels`` default to ``input_ids`` and the shift
            happens in the loss.
        base: an optional collator run first (e.g. the Trainer's ``data_collator``); its output
            is then made DP-safe (labels -100 on padding, the engine mask).
        engine_mask: replace a 2-D ``attention_mask`` by the mask the per-example engines
            accept (default); ``False`` keeps it as it is (evaluation: a plain forward).
        pad_to: pad every batch's tokens to this length (one shape for a compiled step; a
            batch already longer keeps its length). Default ``None``: the batch's longest.

    Example:
        >>> collate = DPDataCollator(pad_token_id=0, causal=True)
        >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
        >>> batch["labels"].tolist(), "attention_mask" in batch
        ([[5, 6, 7], [8, -100, -100]], False)
        >>> DPDataCollator(causal=True, pad_to=4)([{"input_ids": [5, 6]}])["labels"].tolist()
        [[5, 6, -100, -100]]
    """

    def __init__(
        self,
        *,
        pad_token_id: int = 0,
        causal: bool,
        base: Callable[[list[Any]], Any] | None = None,
        engine_mask: bool = True,
        pad_to: int | None = None,
    ) -> None:
        if base is not None and not callable(base):
            raise InputTypeError(f"base={base!r}: expected a collator (a callable)")
        if pad_to is not None and not (isinstance(pad_to, int) and pad_to >= 1):
            raise InputTypeError(f"pad_to={pad_to!r}: expected a number of tokens ≥ 1 or None")
        self.pad_to = pad_to
        self.pad_token_id = int(pad_token_id)
        self.causal = bool(causal)
        self.base = base
        self.engine_mask = bool(engine_mask)

    def _collate(self, features: list[Any]) -> dict[str, Any]:
        if self.base is not None:
            batch = self.base(features)
            if not isinstance(batch, Mapping):
                raise InputTypeError(
                    f"the data collator returned {type(batch).__name__}; DPTrainer needs a dict "
                    "of tensors (input_ids, labels, ...)"
                )
            return _with_mask(dict(batch), features)
        if not all(isinstance(f, Mapping) for f in features):
            raise InputTypeError("DPDataCollator: every example must be a dict (input_ids, ...)")
        keys = set(features[0])
        odd = next((i for i, f in enumerate(features) if set(f) != keys), None)
        if odd is not None:
            raise ConfigurationError(
                f"DPDataCollator: record {odd} of the batch has the fields "
                f"{sorted(features[odd])}, record 0 {sorted(keys)}: every record must have the "
                "same fields (one record without labels would drop every row's labels, or "
                "another record's key would be lost); give every record the same fields"
            )
        batch = {}
        for key in features[0]:
            rows = [f[key] for f in features]
            value = -100 if key == "labels" else 0 if key in _PAD_ZERO else self.pad_token_id
            if key == "input_ids" or key in _PAD_ZERO or key == "labels":
                batch[key] = _pad(rows, value)
            else:
                batch[key] = _pad(rows, 0)
        if "attention_mask" not in batch and "input_ids" in batch:
            lengths = [len(f["input_ids"]) for f in features]
            width = batch["input_ids"].shape[1]
            batch["attention_mask"] = _length_mask(lengths, width)
        return batch

    def _aligned(self, features: list[Any]) -> dict[str, Any]:
        """The collated batch, labels under their name, padded to ``pad_to``, right-aligned."""
        batch = self._collate(features)
        for alias in ("label", "label_ids"):
            if alias in batch and "labels" not in batch:
                batch["labels"] = batch.pop(alias)
        if "input_ids" not in batch:
            raise ConfigurationError(
                f"DPDataCollator: the batch has no input_ids (keys {sorted(batch)})"
            )
        if self.pad_to is not None:
            batch = self._padded(batch, self.pad_to)
        return right_aligned(batch)

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        """Collate ``features`` (a list of examples) into a DP-safe batch dict."""
        import torch

        batch = self._aligned(features)
        mask = batch.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) else None
        check_rows(  # one row per record, its own tokens (a classifier's padding its pad id)
            torch.as_tensor(batch["input_ids"]),
            mask,
            features,
            None if self.causal else self.pad_token_id,
        )
        if self.base is not None and len(features) > 1:
            # a user collator: each row must be what it makes of its record alone (tokens and
            # labels), whatever the records hold (text a tokenizing collator reads, say)
            check_alone(batch, mask, [self._aligned([f]) for f in features], causal=self.causal)
        batch.pop("attention_mask", None)
        if self.causal:
            labels = batch.get("labels")
            if labels is None:
                labels = batch["input_ids"].clone()
            else:
                labels = torch.as_tensor(labels).clone()
            if mask is not None and mask.dim() == 2:
                labels = labels.masked_fill(~mask.bool(), -100)  # padding is never a target
            batch["labels"] = labels
        if mask is not None and not self.engine_mask:
            batch["attention_mask"] = mask
        elif mask is not None:
            converted = engine_mask(torch.as_tensor(mask), causal=self.causal)
            if converted is not None:
                batch["attention_mask"] = converted
        return batch

    def _padded(self, batch: dict[str, Any], length: int) -> dict[str, Any]:
        """*batch* with every per-token tensor (``[B, T]`` like ``input_ids``) padded to
        *length* tokens: the pad id, -100 for a causal LM's labels, 0 otherwise (other labels
        are left as they are: ``[B, K]`` may be K classes)."""
        import torch

        ids = torch.as_tensor(batch["input_ids"])
        if ids.dim() != 2 or ids.shape[1] >= length:
            return batch
        rows, width = ids.shape
        out = dict(batch)
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.shape[:1] != (rows,):
                continue
            if value.dim() > 2:
                raise ConfigurationError(
                    f"DPDataCollator(pad_to={length}): the collated {key!r} has shape "
                    f"{tuple(value.shape)}, which cannot be padded to {length} tokens; have the "
                    "data collator return per-token tensors [batch, tokens] (a 2-D mask)"
                )
            if key == "labels" and not self.causal:
                continue
            if value.dim() == 2 and value.shape[1] == width:
                fill = -100 if key == "labels" else self.pad_token_id if key == "input_ids" else 0
                out[key] = torch.nn.functional.pad(value, (0, length - width), value=fill)
        return out


class PoissonBatches:
    """``batch_sampler`` of the training ``DataLoader``: logical Poisson batches in chunks.

    ``sampler()`` returns the DP sampler when iteration starts (it is built with the
    optimizer, after the loader). Each logical step's indices (this rank's shard, sorted) are
    split into ``chunks`` contiguous physical batches whose sizes differ by at most one; a
    physical batch may be empty. One epoch is ``steps_per_epoch`` logical steps. The sampler's
    position is the only state: a resumed run continues from the restored position.
    """

    def __init__(self, sampler: Callable[[], Any], *, chunks: int, steps_per_epoch: int) -> None:
        self._sampler = sampler
        self.chunks = int(chunks)
        self.steps_per_epoch = int(steps_per_epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.chunks

    def __iter__(self) -> Iterator[list[int]]:
        from opake.dpsgd.sampling import PoissonSampler, UnitPoissonSampler

        sampler = self._sampler()
        if not isinstance(sampler, PoissonSampler | UnitPoissonSampler):
            raise ConfigurationError(
                f"PoissonBatches got sampler={type(sampler).__name__}: expected the DP step's "
                "PoissonSampler or FixedShapePoissonSampler (ε is computed for Poisson sampling "
                "only); do not replace the sampler of DPTrainer's training loader"
            )
        stream: Iterator[list[int]] = iter(())
        for _ in range(self.steps_per_epoch):
            indices = next(stream, None)
            if indices is None:
                stream = iter(sampler)
                indices = next(stream)
            yield from physical_batches(sampler, indices, self.chunks)


def physical_batches(sampler: Any, indices: Sequence[int], chunks: int) -> list[list[int]]:
    """A logical batch's physical batches: :func:`split`, or cut at unit boundaries only for a
    unit sampler (a unit's records are clipped together, in one physical batch)."""
    units_of = getattr(sampler, "units_of", None)
    if units_of is None:
        return split(indices, chunks)
    from opake.transformers._sampling import split_units

    return split_units(indices, units_of(indices).tolist(), chunks)


def split(indices: Sequence[int], chunks: int) -> list[list[int]]:
    """``chunks`` contiguous parts of ``indices`` with sizes differing by at most one.

    >>> split([1, 4, 6, 9, 12], 2)
    [[1, 4, 6], [9, 12]]
    >>> split([3], 3)
    [[3], [], []]
    """
    size, extra = divmod(len(indices), chunks)
    out = []
    start = 0
    for k in range(chunks):
        end = start + size + (1 if k < extra else 0)
        out.append(list(indices[start:end]))
        start = end
    return out
