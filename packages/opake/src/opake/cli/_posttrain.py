"""The training side of SFT and DPO records in ``opake train``, on the library's losses.

The losses are :mod:`opake.transformers.losses`' (the same as ``DPSFTTrainer`` and
``DPDPOTrainer`` use), each wrapped in :class:`~opake.dpsgd.bookkeeping.BatchedLoss` so that both
clipping engines run them:

- SFT: :func:`~opake.transformers.losses.completion_losses`, one record one row, its loss the
  mean negative log-likelihood over its own target tokens (``labels`` -100 elsewhere: prompt
  tokens get no gradient);
- DPO: :class:`~opake.transformers.losses.DPOLoss`, a record's chosen and rejected rows weighed
  by one forward without gradient (:meth:`~opake.transformers.losses.DPOLoss.prepare`), then
  clipped **together** as one privacy unit (``accumulate(..., units=, records=)``, each unit
  checked to be one drawn record): one record moves the clipped sum by at most C, and sampling
  and accounting count records.

The DPO reference is the starting model: before the first step (and before a checkpoint is
restored), each record's summed completion log-probabilities under it are computed once, from
that record alone — no second copy of the model stays in memory, with or without LoRA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from opake.cli._plan import RunPlan
    from opake.dpsgd.clipping import ClipAux

__all__ = ["PostStep", "run_loss"]

#: pairs of one forward without gradient (the reference and the validation log-probabilities):
#: 64 rows, as many as one chunk of the validation loss of text blocks
_CHUNK = 32


class PostStep:
    """The loss, the batches and the validation loss of an SFT or DPO run.

    Args:
        plan: the run's plan (``plan.post`` set).
        fmodel: ``make_functional``'s function of the model.
        model: the model (PEFT or plain).
        params: ``(trainable, frozen)``.
        forward_kwargs: the run's forward options (``loss_only`` where the model is patched).
        autocast: the compute-precision context factory.
        device: where the batches go.
    """

    def __init__(
        self,
        plan: RunPlan,
        fmodel: Callable[..., Any],
        model: Any,
        params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
        *,
        forward_kwargs: dict[str, Any],
        autocast: Callable[[], Any],
        device: torch.device,
    ) -> None:
        from opake.dpsgd.bookkeeping import BatchedLoss
        from opake.transformers.losses import DPOLoss, completion_losses

        assert plan.post is not None
        assert plan.train_labels is not None
        self.plan, self.model, self.params, self.device = plan, model, params, device
        self.forward_kwargs, self.autocast = forward_kwargs, autocast
        loss_only = bool(forward_kwargs.get("loss_only"))
        #: one row's completion loss: SFT's loss, and the memory probe's for both objectives
        self.row_loss = BatchedLoss(
            completion_losses(fmodel, model, loss_only=loss_only, autocast=autocast), fmodel
        )
        self.dpo: DPOLoss | None = None
        self.loss: Any = self.row_loss
        self.rows = plan.post.rows_per_record
        self.reference: tuple[torch.Tensor, torch.Tensor] | None = None
        if plan.post.objective == "dpo":
            assert plan.post.beta is not None
            assert plan.val_labels is not None
            self.dpo = DPOLoss(
                fmodel, model, beta=plan.post.beta, loss_only=loss_only, autocast=autocast
            )
            self.loss = BatchedLoss(self.dpo, fmodel)
            # the starting model's log-probabilities, each from its own record
            self.reference = (
                self._log_probs(plan.train, plan.train_labels),
                self._log_probs(plan.val, plan.val_labels),
            )

    def probe_batch(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The memory probe's batch from random token ids: one row per record (two for DPO)."""
        import torch

        rows = ids if self.rows == 1 else torch.cat([ids] * self.rows)
        return {"input_ids": rows, "labels": rows.clone()}

    @staticmethod
    def _pairs(ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[P, 2, L]`` pairs as ``2P`` rows: the chosen ones, then the rejected ones (the
        layout :class:`~opake.transformers.losses.DPOLoss` reads)."""
        import torch

        return {
            "input_ids": torch.cat([ids[:, 0], ids[:, 1]]),
            "labels": torch.cat([labels[:, 0], labels[:, 1]]),
        }

    def _log_probs(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each pair's summed completion log-probabilities ``[P, 2]`` (chosen, rejected) under
        the model as it is now, without gradient, in evaluation mode."""
        import torch

        assert self.dpo is not None
        was_training = self.model.training
        self.model.eval()
        out = [torch.zeros(0, 2)]
        with torch.no_grad():
            for chunk in torch.split(torch.arange(ids.shape[0]), _CHUNK):
                batch = self._pairs(ids[chunk].to(self.device), labels[chunk].to(self.device))
                logp = self.dpo.log_probs(*self.params, batch).float()
                out.append(torch.stack(logp.chunk(2), dim=1).cpu())
        self.model.train(was_training)
        return torch.cat(out)

    def accumulate(
        self, training: Any, indices: Sequence[int], mask: torch.Tensor | None
    ) -> tuple[ClipAux, torch.Tensor]:
        """Clip and sum the records *indices* (padding slots of a fixed-shape batch: -1, masked
        out) into the pending step; returns the aux and each slot's loss (not private)."""
        import torch

        plan = self.plan
        assert plan.train_labels is not None
        index = torch.as_tensor(list(indices), dtype=torch.long).clamp_min(0)
        ids = plan.train[index].to(self.device)
        labels = plan.train_labels[index].to(self.device)
        if self.dpo is None:
            aux = training.accumulate({"input_ids": ids, "labels": labels}, example_mask=mask)
            return aux, aux.loss_values
        from opake.transformers.losses import (
            accumulate_pairs,
            dpo_losses_from_margins,
            weighs_in_forward,
        )

        assert self.reference is not None
        if not len(index):  # an empty Poisson batch adds zeros (no forward to weigh)
            from opake.transformers.losses import WEIGHT_KEY

            empty = {**self._pairs(ids, labels), WEIGHT_KEY: torch.zeros(0, device=self.device)}
            return training.accumulate(empty, example_mask=mask), torch.zeros(0)
        ref = self.reference[0][index].to(self.device)
        rows = self._pairs(ids, labels)
        rows_mask = None if mask is None else torch.cat([mask] * self.rows)
        # each row's record (padding slots: -1, masked out): the step checks each unit
        # against it (one unit per drawn record)
        records = [int(i) for i in indices] * self.rows
        if weighs_in_forward(training):  # weighed by the clipped forward itself
            done = accumulate_pairs(
                self.dpo,
                training,
                rows,
                ref_chosen=ref[:, 0],
                ref_rejected=ref[:, 1],
                example_mask=rows_mask,
                records=records,
            )
            if done is not None:
                return done[0], dpo_losses_from_margins(done[1])
        # the pairs' weights from one forward without gradient; pair i's two rows share the
        # unit id i (its slot in this step's only physical batch) and are clipped as one
        prepared = self.dpo.prepare(
            *self.params, rows, ref_chosen=ref[:, 0], ref_rejected=ref[:, 1]
        )
        aux = training.accumulate(
            prepared.batch, example_mask=rows_mask, units=prepared.units, records=records
        )
        return aux, prepared.losses

    def evaluate(self) -> float:
        """The validation loss: nats per target token (SFT), or the mean DPO loss of the
        validation pairs against the starting model (ln 2 at the start)."""
        from opake.cli._setup import _evaluate

        plan = self.plan
        assert plan.val_labels is not None
        if self.dpo is None:
            return _evaluate(
                self.model,
                plan.val,
                self.device,
                self.autocast,
                self.forward_kwargs,
                labels=plan.val_labels,
            )
        from opake.transformers.losses import dpo_losses

        assert self.reference is not None
        now, ref = self._log_probs(plan.val, plan.val_labels), self.reference[1]
        losses = dpo_losses(now[:, 0], now[:, 1], ref[:, 0], ref[:, 1], beta=self.dpo.beta)
        return float(losses.mean())


def run_loss(
    plan: RunPlan,
    fmodel: Callable[..., Any],
    model: Any,
    params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    *,
    forward_kwargs: dict[str, Any],
    autocast: Callable[[], Any],
    device: torch.device,
    world_size: int,
) -> tuple[Any, PostStep | None]:
    """The loss ``DPTraining`` differentiates, and the post-training step (``None`` for
    language modelling on text blocks).

    Raises:
        ConfigurationError: DPO under ``torchrun`` (a pair is one privacy unit, in one process).
    """
    from opake.cli._setup import per_example_loss

    if plan.post is None:
        return per_example_loss(plan, fmodel, forward_kwargs, autocast), None
    if plan.post.objective == "dpo" and world_size > 1:
        from opake.core.errors import ConfigurationError

        raise ConfigurationError(
            f"--objective dpo with {world_size} processes: a record's chosen and rejected rows "
            "are one privacy unit, clipped in one process; run DPO without torchrun"
        )
    post = PostStep(
        plan, fmodel, model, params, forward_kwargs=forward_kwargs, autocast=autocast, device=device
    )
    return post.loss, post
