"""One row per record: what a collated batch must be before any example's gradient is formed.

Per-example clipping bounds what one *row* adds. A collator that packs records into shared rows
(one record's tokens followed by the next's) lets one record move every later row — its
positions, its targets — and so the clipped sum by several C (a review measured 5.4·C); the
"summed ≤ drawn" count of the step cannot see it (as many rows as records). A sequence
classifier pools the rightmost token that is not ``config.pad_token_id``: padding of another id
makes it pool a padding position, which the batch's longest record sets (2.5–2.8·C measured).
:func:`check_rows` refuses both, for every batch, whatever collator built it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["check_alone", "check_classifier_padding", "check_rows"]


def check_rows(
    ids: torch.Tensor, mask: torch.Tensor | None, features: Sequence[Any], pad: int | None
) -> None:
    """Refuse a collated batch unless row ``i`` holds record ``i`` alone: as many rows as
    records, each row's kept tokens (``mask`` 1, right-aligned) a prefix of its record's
    ``input_ids`` (truncation allowed) and, with ``pad`` (a sequence classifier's pad id),
    every padding position holding ``pad``.

    >>> import torch
    >>> check_rows(torch.tensor([[5, 6], [7, 0]]), torch.tensor([[1, 1], [1, 0]]),
    ...            [{"input_ids": [5, 6]}, {"input_ids": [7]}], pad=0)
    >>> check_rows(torch.tensor([[5, 6], [7, 8]]), None,
    ...            [{"input_ids": [5]}, {"input_ids": [6, 7, 8]}], pad=None)
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: the data collator's row 0 holds tokens that are not its record's (records packed into shared rows?): one record would change the other rows' positions and targets, beyond what per-example clipping bounds. Return one row per record, its own tokens then padding
    """  # noqa: E501 - the doctest's expected message is one line
    import torch

    if ids.dim() != 2:
        raise ConfigurationError(
            f"the data collator returned input_ids of shape {tuple(ids.shape)}: DP training "
            "needs [records, tokens], one row per record, so that each record's rows can be "
            "checked against the record and clipped as one example"
        )
    if int(ids.shape[0]) != len(features):
        raise ConfigurationError(
            f"the data collator returned {int(ids.shape[0])} rows for {len(features)} records: "
            "DP-SGD clips each record's gradient, so each record must be one row of its own "
            "(packing records into rows, or splitting one, breaks the privacy unit)"
        )
    if mask is not None and (mask.dim() != 2 or mask.shape != ids.shape):
        raise ConfigurationError(
            f"the data collator returned an attention_mask of shape {tuple(mask.shape)} for "
            f"input_ids of shape {tuple(ids.shape)}: DP training checks each row's kept tokens "
            "against its record with a [records, tokens] padding mask (a 4-D or block mask "
            "could join records in one row). Return a 2-D attention_mask of 1s and 0s"
        )
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if pad is not None and bool((ids[~keep] != pad).any()):
        raise ConfigurationError(
            f"the data collator padded with an id other than the model's config.pad_token_id "
            f"({pad}): a sequence classifier pools the rightmost token that is not the pad id, "
            "so it would pool a padding position, which the batch's longest record sets. Pad "
            "input_ids with config.pad_token_id (pass processing_class=tokenizer whose "
            "pad_token_id it is)"
        )
    if not all(isinstance(f, Mapping) and "input_ids" in f for f in features):
        return
    for row, feature in enumerate(features):
        own = torch.as_tensor(feature["input_ids"]).reshape(-1).to(ids)
        kept = ids[row][keep[row]]
        if kept.numel() > own.numel() or not torch.equal(kept, own[: kept.numel()]):
            raise ConfigurationError(
                f"the data collator's row {row} holds tokens that are not its record's (records "
                "packed into shared rows?): one record would change the other rows' positions "
                "and targets, beyond what per-example clipping bounds. Return one row per "
                "record, its own tokens then padding"
            )


def _rows_of(value: torch.Tensor, ids: torch.Tensor, key: str, causal: bool) -> bool:
    """Whether ``value`` is per token (``[records, tokens, ...]`` like ``ids``): a causal LM's
    labels are, a classifier's are not, any other key by its shape."""
    if key == "labels":
        return causal
    return value.dim() >= 2 and tuple(value.shape[:2]) == tuple(ids.shape[:2])


def _row(
    batch: Mapping[str, Any], mask: torch.Tensor | None, row: int, key: str, causal: bool
) -> tuple[torch.Tensor, bool] | None:
    """Row ``row`` of ``batch[key]`` and whether it is per token (then only its kept
    positions, all of them without a mask); ``None`` if absent or not a tensor."""
    import torch

    value = batch.get(key)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        try:  # numpy arrays, nested lists of numbers: what the model or the loss would read
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return None  # strings and the like: no numbers for the model to train on
    ids = torch.as_tensor(batch["input_ids"])
    if value.dim() == 0 or int(value.shape[0]) != int(ids.shape[0]):
        return (value, False)  # not per record: must be the same alone and in the batch
    if not _rows_of(value, ids, key, causal):
        return (value[row], False)
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    if tuple(keep.shape) != tuple(value.shape[:2]):
        raise ConfigurationError(
            f"the data collator's {key!r} has shape {tuple(value.shape)}, its attention mask "
            f"{tuple(keep.shape)}: DP training needs per-token values [records, tokens]"
        )
    return (value[row][keep[row].to(value.device)], True)


def _same(got: tuple[torch.Tensor, bool] | None, own: tuple[torch.Tensor, bool] | None) -> bool:
    """Whether a row's value is its record's alone: per token, the same kept values (as many:
    a row cut to another record's length is not its record's), equal otherwise."""
    import torch

    if got is None or own is None:
        return got is None and own is None
    (a, a_tokens), (b, b_tokens) = got, own
    return a_tokens == b_tokens and a.shape == b.shape and torch.equal(a, b)


def check_alone(
    batch: Mapping[str, Any],
    mask: torch.Tensor | None,
    alone: Sequence[Mapping[str, Any]],
    *,
    causal: bool,
) -> None:
    """Refuse a batch from a user collator unless row ``i`` is what the collator makes of
    record ``i`` alone (``alone[i]``, collated by itself), for every tensor the model gets:
    per-token values (``input_ids``, a causal LM's labels, ``position_ids``, ...) the record's
    at the kept positions, as many of them (a row cut to the batch's shortest record is
    not its record's), per-row values (a classifier's label) equal; array-likes (numpy,
    nested lists) compared as tensors. This
    checks records a collator tokenizes itself (no ``input_ids`` to compare with), labels, and
    inputs such as position ids that a batch's longest record could set.

    >>> import torch
    >>> alone = [{"input_ids": torch.tensor([[5, 6]])}, {"input_ids": torch.tensor([[7, 8]])}]
    >>> check_alone({"input_ids": torch.tensor([[5, 6], [7, 8]])}, None, alone, causal=True)
    >>> check_alone({"input_ids": torch.tensor([[5, 7], [6, 8]])}, None, alone, causal=True)
    Traceback (most recent call last):
    ...
    opake.core.errors.ConfigurationError: the data collator's row 0 is not what it makes of record 0 alone (its input_ids differ): records mixed into shared rows would let one record change the other rows' tokens or targets, beyond what per-example clipping bounds. Return one row per record, from that record only
    """  # noqa: E501 - the doctest's expected message is one line
    import torch

    for row, single in enumerate(alone):
        ids = torch.as_tensor(single.get("input_ids"))
        own_mask = single.get("attention_mask")
        own_mask = own_mask if isinstance(own_mask, torch.Tensor) else None
        if ids.dim() != 2 or int(ids.shape[0]) != 1:
            raise ConfigurationError(
                f"the data collator made input_ids of shape {tuple(ids.shape)} from record "
                f"{row} alone: DP training needs one row per record"
            )
        others = {str(k) for k in (*batch, *single)} - {"input_ids", "attention_mask"}
        keys = ["input_ids", *sorted(others)]
        for key in keys:
            got = _row(batch, mask, row, key, causal)
            own = _row(single, own_mask, 0, key, causal)
            if not _same(got, own):
                raise ConfigurationError(
                    f"the data collator's row {row} is not what it makes of record {row} alone "
                    f"(its {key} differ): records mixed into shared rows would let one record "
                    "change the other rows' tokens or targets, beyond what per-example clipping "
                    "bounds. Return one row per record, from that record only"
                )


def check_classifier_padding(model: Any, collator_pad: int) -> int:
    """A sequence classifier's pad id: ``config.pad_token_id``, which must be set and equal to
    the id the collator pads with (``collator_pad``); else ``ConfigurationError``. transformers
    pools the rightmost token that is not the pad id, and with none set takes the last position
    of a one-row batch — under the per-example engine, always a padding slot whose index the
    batch's longest record sets.

    >>> from types import SimpleNamespace
    >>> check_classifier_padding(SimpleNamespace(config=SimpleNamespace(pad_token_id=0)), 0)
    0
    """
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, bool) or not isinstance(pad, int):
        raise ConfigurationError(
            f"{type(model).__name__}: config.pad_token_id is {pad!r}; a sequence classifier "
            "pools the rightmost token that is not the pad id, and without one it pools the "
            "last position of each row — a padding slot whose index the batch's longest record "
            "sets. Set model.config.pad_token_id = tokenizer.pad_token_id (and pass "
            "processing_class=tokenizer)"
        )
    if pad != collator_pad:
        raise ConfigurationError(
            f"{type(model).__name__}: config.pad_token_id={pad} but the collator pads with "
            f"{collator_pad} (the processing_class's pad_token_id, or 0 without one): the "
            "classifier would pool a padding position. Make them equal (model.config."
            "pad_token_id = tokenizer.pad_token_id, processing_class=tokenizer)"
        )
    return pad
