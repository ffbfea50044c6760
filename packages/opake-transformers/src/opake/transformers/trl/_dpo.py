"""``DPDPOTrainer``: TRL's ``DPOTrainer`` with the DP-SGD step of ``DPTrainer``.

TRL prepares the preference records (``prompt``/``chosen``/``rejected``, plain or
conversational) and collates ``P`` of them into ``2P`` rows (the chosen sequences, then the
rejected ones). The DP step is :class:`opake.transformers.losses.DPOLoss`'s: per physical
batch, the reference log-probabilities (the frozen reference, the model with its adapters
disabled, or TRL's precomputed columns) and one policy forward without gradient give each row
its DPO weight; the clipping engine then differentiates the rows and clips each record's two
rows together, as one privacy unit (``units=``, book-keeping and ``vmap`` alike). Once a call
has run on the book-keeping engine, the weights come from the clipped forward itself
(:meth:`DPOLoss.pairs`: no forward without gradient); a call that falls back to ``vmap`` is
weighed first. One record moves the clipped sum by at most ``C``; ε is accounted over
records.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.dpo_trainer import DPOTrainer

from opake.core.errors import ConfigurationError, InputTypeError
from opake.transformers._collate import engine_mask, right_aligned
from opake.transformers._dp_mixin import DPTrainerMixin
from opake.transformers._losses import has_dropout
from opake.transformers._positions import check_positions
from opake.transformers.losses import (
    DPOLoss,
    accumulate_pairs,
    completion_losses,
    dpo_losses_from_margins,
    loss_only_available,
    weighs_in_forward,
)
from opake.transformers.trl._config import DPDPOConfig
from opake.transformers.trl._refusals import check_built, check_dpo_config
from opake.transformers.trl._truncation import Truncation, count_dpo, report, with_counts

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    #: TRL's ``compute_ref_log_probs(model, inputs)`` (the model as TRL holds it): the chosen
    #: and rejected log-probabilities
    _RefLogProbs = Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]

__all__ = ["DPDPOTrainer", "PreferenceRows"]

#: the 2-D attention mask kept beside the rows for the reference forward (not a model input)
_MASK_KEY = "opake_attention_mask"
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _check_collator(collator: object) -> None:
    """Refuse a preference collator other than TRL's own: a pair's rows are not checked
    against the pair collated alone (a collator cutting rows to the batch's shortest pair
    moved the sum by 2.21·C)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    if collator is None or type(collator) is DataCollatorForPreference:
        return
    raise ConfigurationError(
        f"DPDPOTrainer(data_collator={type(collator).__name__}): a preference collator of "
        "your own is not checked pair by pair (one pair could set the other rows' lengths or "
        "targets, beyond what per-example clipping bounds); leave data_collator out (TRL's "
        "DataCollatorForPreference, with the processing class's pad id) or pass one"
    )


class PreferenceRows:
    """TRL's preference collator made DP-safe: ``labels`` -100 on the prompt and padding (from
    its ``completion_mask``), the 2-D attention mask replaced by what both engines accept
    (nothing for right padding) and kept aside for the reference forward."""

    def __init__(self, base: Callable[[list[Any]], Any]) -> None:
        self.base = base

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = dict(self.base(features))
        mask = batch.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(batch["input_ids"])
        # a collator that pads on the left: each row's tokens moved to position 0 (its mask
        # and completion mask alike), so no record's positions depend on the longest one
        rows = right_aligned(
            {
                "input_ids": batch["input_ids"],
                "attention_mask": mask,
                "completion_mask": batch.pop("completion_mask"),
            }
        )
        ids, mask, completion = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
        out: dict[str, Any] = {
            "input_ids": ids,
            "labels": ids.masked_fill((completion == 0) | (mask == 0), -100),
            _MASK_KEY: mask,
        }
        converted = engine_mask(mask, causal=True)
        if converted is not None:
            out["attention_mask"] = converted
        for key in _REF_KEYS:
            if key in batch:
                out[key] = batch[key]
        return out


class DPDPOTrainer(DPTrainerMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` that trains with DP-SGD (one preference record = one example).

    Takes every ``DPOTrainer`` argument (``model``, ``ref_model``, ``args``, ``train_dataset``,
    ``processing_class``, ``peft_config``, …) as keywords, with ``args`` a
    :class:`~opake.transformers.trl.DPDPOConfig`, and TRL's preference formats. The guarantees
    are ``DPTrainer``'s (Poisson sampling over records, ε/δ/σ/q in every log, budget stop, exact
    resume, its refusals) plus the refusals of loss types other than ``"sigmoid"`` and of the
    options that change it (``loss_weights``, ``f_divergence_type``, ``ld_alpha``,
    ``label_smoothing``, ``use_weighting``), ``sync_ref_model``, ``padding_free``,
    ``activation_offloading``, ``use_liger_kernel``, several processes, active dropout
    (``disable_dropout=False``: the weight forward and the gradient forward would draw
    different masks), a vision dataset, a Mixture-of-Experts load-balancing loss and a
    reference model whose rotary embedding depends on the batch's length.

    The reference model: ``ref_model`` if given; else, with PEFT, the same model with its
    adapters disabled (no second copy); else a frozen copy of ``model`` made here (TRL would
    load one from the model's name), unless ``precompute_ref_log_probs=True`` computes the
    reference log-probabilities once before training (each from its own record) and keeps no
    reference at all. To resume, build the trainer from the same *initial* model: the
    checkpoint's weights go to the policy only.

    On the book-keeping engine each pair's weights come from the clipped forward itself, from
    the second call on and for the first physical batch of each step (:meth:`DPOLoss.pairs`);
    other batches, and the ``vmap`` engine, take one policy forward without gradient more
    than TRL's (the pairs' weights).
    ``rewards/margins`` and ``rewards/accuracies`` are logged as TRL logs them (not private).
    TRL's telemetry is off.

    Attributes:
        truncation: what ``max_length`` does to each dataset (not private), also logged.
        uses_loss_only: whether log-probabilities come from the patched model's loss-only head.
    """

    _wraps_trainer_collator = True

    def __init__(self, *args: Any, ref_model: Any = None, **kwargs: Any) -> None:
        if "per_example_loss" in kwargs:
            raise ConfigurationError(
                "DPDPOTrainer's per-example loss is the DPO loss of each pair; for another "
                "loss use opake.transformers.DPTrainer(per_example_loss=...)"
            )
        _check_collator(kwargs.get("data_collator"))
        config = kwargs.get("args")
        model = kwargs.get("model")
        if isinstance(config, DPDPOConfig):
            check_dpo_config(config)
            if ref_model is None and _needs_reference_copy(model, config, kwargs):
                ref_model = _frozen_copy(model)
        self.truncation: dict[str, Truncation] = {}
        self.uses_loss_only = (
            model is not None and not isinstance(model, str) and loss_only_available(model)
        )
        if ref_model is not None and not isinstance(ref_model, str):
            check_positions(ref_model, "DPDPOTrainer(ref_model=...)")
        super().__init__(*args, ref_model=ref_model, **kwargs)
        check_built(self)
        built = getattr(self, "ref_model", None)
        if built is not None and built is not ref_model:  # one TRL loaded from a name
            check_positions(built, "DPDPOTrainer's reference model")
        if has_dropout(self.model):
            raise ConfigurationError(
                "DPDPOTrainer: the model has active dropout (disable_dropout=False): each "
                "pair's weight comes from a forward without gradient and its gradient from a "
                "second forward, which would draw different dropout masks; keep "
                "disable_dropout=True"
            )
        self._dpo_loss: DPOLoss | None = None

    def _check_arguments_type(self, training_args: object) -> None:
        if not isinstance(training_args, DPDPOConfig):
            raise InputTypeError(
                f"DPDPOTrainer(args={type(training_args).__name__}): expected DPDPOConfig "
                "(TRL's DPOConfig plus target_epsilon / noise_multiplier, target_delta, "
                "per_sample_max_grad_norm, ...)"
            )

    def _send_telemetry(self) -> None:
        """Opake's DP trainers send nothing anywhere."""

    def _prepare_dataset(
        self, dataset: Any, processing_class: Any, args: Any, name: str
    ) -> Dataset | IterableDataset:
        """TRL's preparation without its ``max_length`` filter, counted, then filtered as TRL
        does (a record whose prompt alone fills ``max_length`` is dropped, ``keep_start``)."""
        import datasets

        max_length = args.max_length
        if max_length is None or not isinstance(dataset, datasets.Dataset):
            return super()._prepare_dataset(dataset, processing_class, args, name)
        whole = copy.copy(args)
        whole.max_length = None
        prepared = super()._prepare_dataset(dataset, processing_class, whole, name)
        counts, keep = count_dpo(prepared, max_length, args.truncation_mode == "keep_start")
        self.truncation[name] = counts
        report("DPDPOTrainer", name, counts)
        return prepared if len(keep) == len(prepared) else prepared.select(keep)

    # -- the DP step ----------------------------------------------------------------------------

    def _dp_collator(
        self, *, engine_mask: bool = True, pad_to: int | None = None
    ) -> Callable[[list[Any]], dict[str, Any]]:
        """TRL's preference collator, each pair's rows side by side (``pad_to`` is for a
        compiled step, which ``DPDPOTrainer`` refuses)."""
        return PreferenceRows(self._user_collator)

    def _batched_losses(self, fmodel: Any, model: Any) -> Callable[..., torch.Tensor]:
        self._dpo_loss = DPOLoss(
            fmodel,
            model,
            beta=self.args.beta,
            loss_only=self.uses_loss_only,
            autocast=self._autocast(),
        )
        return self._dpo_loss

    def _probe(self, loss: Any, fmodel: Any, model: Any) -> tuple[Any, int, int | None]:
        """The memory probe: a row's causal-LM loss (the DPO rows' forward and backward, on
        random tokens), two rows per record, rows as long as the longest collated one."""
        from opake.dpsgd.bookkeeping import BatchedLoss

        rows = BatchedLoss(completion_losses(fmodel, model, loss_only=self.uses_loss_only), fmodel)
        return rows, 2, _longest_row(self.train_dataset, self.args.max_length)

    def _accumulate(
        self,
        dp: Any,
        batch: dict[str, Any],
        mask: torch.Tensor | None,
        indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Weigh each pair's rows (reference and policy log-probabilities, no gradient), then
        clip and sum with each record's two rows as one unit (with ``privacy_unit_column``: all
        rows of a user's pairs as one unit); returns the pairs' DPO losses."""
        assert self._dpo_loss is not None
        assert self._dp_params is not None
        attention = batch.pop(_MASK_KEY)
        ref = [batch.pop(key, None) for key in _REF_KEYS]
        pairs = int(batch["input_ids"].shape[0]) // 2
        if ref[0] is None or ref[1] is None:
            ref = list(self._reference(batch, attention, pairs))
        ids = _unit_ids(indices, pairs, batch["input_ids"].device)
        rows_mask = None if mask is None else torch.cat([mask, mask])
        # each row's record (both rows of a pair): with units=, checked one unit per record;
        # user-level (privacy_unit_column), the units themselves come from the records
        records = [] if indices is None else [int(i) for i in indices.tolist()] * 2
        # weighed by the clipped forward itself on book-keeping (see losses._in_forward)
        if pairs and weighs_in_forward(dp):
            done = accumulate_pairs(
                self._dpo_loss,
                dp,
                batch,
                ref_chosen=ref[0],
                ref_rejected=ref[1],
                ids=ids,
                example_mask=rows_mask,
                records=records,
            )
            if done is not None:
                self._record(done[1], mask)
                return dpo_losses_from_margins(done[1])
        trainable, frozen = self._dp_params
        prepared = self._dpo_loss.prepare(
            trainable, frozen, batch, ref_chosen=ref[0], ref_rejected=ref[1], ids=ids
        )
        self._clip(dp, prepared.batch, rows_mask, prepared.units, records)
        self._record(prepared.margins, mask)
        return prepared.losses

    @staticmethod
    def _clip(
        dp: Any,
        batch: dict[str, Any],
        rows_mask: torch.Tensor | None,
        units: torch.Tensor,
        records: list[int],
    ) -> None:
        if dp.privacy_unit == "unit":  # the unit sampler's units, from the records
            dp.accumulate(batch, example_mask=rows_mask, records=records)
        else:  # each pair one unit, checked against its record
            dp.accumulate(batch, example_mask=rows_mask, units=units, records=records)

    def _reference(
        self, batch: Mapping[str, torch.Tensor], attention: torch.Tensor, pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference log-probabilities of this batch's pairs, by TRL's own
        ``compute_ref_log_probs`` (frozen reference, or the adapters disabled)."""
        ids = batch["input_ids"]
        if not pairs:
            empty = torch.zeros(0, device=ids.device)
            return empty, empty
        inputs = {
            "input_ids": ids,
            "attention_mask": attention,
            "completion_mask": (batch["labels"] != -100).long(),
        }
        # TRL's function runs the model it is given (the adapters disabled when there is no
        # reference model and the policy is a PEFT model): the reference, never the policy
        reference = self.ref_model if self.ref_model is not None else self.model
        # TRL leaves compute_ref_log_probs unannotated: its signature, stated
        compute: _RefLogProbs = self.compute_ref_log_probs
        chosen, rejected = compute(reference, inputs)
        return chosen.detach().float(), rejected.detach().float()

    def _record(self, margins: torch.Tensor, mask: torch.Tensor | None) -> None:
        """TRL's reward metrics of the real pairs (diagnostics: not private)."""
        real = margins if mask is None else margins[mask.to(margins.device)]
        if real.numel():
            metrics = self._metrics["train"]
            metrics["rewards/margins"].append(float(real.mean()))
            metrics["rewards/accuracies"].append(float((real > 0).float().mean()))

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ε, δ, σ, q to every log; the truncation counts to the training summary."""
        super().log(with_counts(logs, self.truncation.get("train")), *args, **kwargs)


def _needs_reference_copy(model: Any, config: DPDPOConfig, kwargs: Mapping[str, Any]) -> bool:
    """A frozen copy is the reference unless the model is loaded by name (TRL loads one the
    same way), PEFT gives the reference (adapters disabled), or it is precomputed."""
    if model is None or isinstance(model, str) or config.precompute_ref_log_probs:
        return False
    peft = kwargs.get("peft_config") is not None or hasattr(model, "peft_config")
    return not peft


def _frozen_copy(model: Any) -> torch.nn.Module:
    """The reference model: a copy of the initial policy, frozen and in eval mode."""
    reference: torch.nn.Module = copy.deepcopy(model)  # the policy: a transformers/PEFT module
    reference.requires_grad_(False)
    return reference.eval()


def _unit_ids(indices: torch.Tensor | None, pairs: int, device: torch.device) -> torch.Tensor:
    """Each pair's privacy-unit id: its dataset index (unique in the step); padding slots of a
    fixed-shape batch (index -1) get distinct negative ids (they are masked out)."""
    if indices is None:
        return torch.arange(pairs, device=device)
    ids = indices.to(device=device, dtype=torch.int64)
    slots = -1 - torch.arange(ids.shape[0], device=device)
    return torch.where(ids >= 0, ids, slots)


def _longest_row(dataset: Any, max_length: int | None) -> int | None:
    """The most tokens of a collated row: prompt + the longer completion, cut at max_length."""
    try:
        longest = max(
            (
                len(p) + max(len(c), len(r))
                for p, c, r in zip(
                    dataset["prompt_ids"],
                    dataset["chosen_ids"],
                    dataset["rejected_ids"],
                    strict=True,
                )
            ),
            default=None,
        )
    except (KeyError, TypeError):
        return None
    if longest is None or max_length is None:
        return longest
    return min(longest, int(max_length))
