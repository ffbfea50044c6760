"""The DPO loss per preference pair, one pair = one privacy unit, on both clipping engines.

A batch of ``P`` pairs has ``2P`` rows in TRL's layout: rows ``0 .. P-1`` are the chosen
sequences (prompt + chosen completion), rows ``P .. 2P-1`` the rejected ones, in the same pair
order; ``labels`` are -100 on the prompt and on padding. With ``π`` a row's summed
log-probability of its completion tokens (:func:`sequence_log_probs`) under the policy and
``π_ref`` under the reference model, pair ``i``'s loss is

    ℓ_i = −log σ(β · [(π_c − π_ref,c) − (π_r − π_ref,r)])        (:func:`dpo_losses`)

Its gradient is ``a_i · ∇π_c − a_i · ∇π_r`` with ``a_i = −β σ(−margin_i)``: the gradient of the
row losses ``w_row · π_row`` summed over the pair's two rows, where ``w`` (:func:`dpo_weights`)
is computed from the pair's own four log-probabilities at the current parameters. So
:class:`DPOLoss` works in two steps per physical batch: :meth:`DPOLoss.prepare` runs the policy
once without gradient and attaches each row's ``w`` (and returns the pairs' losses), then the
clipping engine differentiates ``w_row · π_row`` per row and clips each pair — both rows, as
one privacy unit (``units=``) — as a whole. Each row's loss depends on its own tokens and its
pair's ``w`` only, so the per-row check of the book-keeping engine and the per-row ``vmap``
engine both apply unchanged, and the clipped unit gradient is exactly ``∇ℓ_i``: one record moves
the clipped sum by at most ``C``.

With the book-keeping engine the weights can come from the clipped forward itself
(:meth:`DPOLoss.pairs`, no forward without gradient): the batch carries each row's pair id,
role (chosen or rejected) and reference log-probability, and the loss, which sees the whole
microbatch at once, weighs each row from its own pair's two log-probabilities of that forward
(detached). The gradient is the same — ``w`` at the current parameters times ``∇π_row`` — and
so is the guarantee: a row's weight reads its own pair's rows only, found by pair id, never by
position; a microbatch that holds one row of a pair without the other raises. The engine's
per-row checks of the same call take a row's weight from its pair's margin in that forward
(:attr:`DPOLoss.seen`); a row alone with no such forward (the ``vmap`` engine) raises
:class:`PairsNeedBookkeepingError`, and the caller weighs the batch with
:meth:`DPOLoss.prepare` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from opake.core.errors import ConfigurationError, InputTypeError
from opake.transformers.losses._completion import sequence_log_probs, target_counts

if TYPE_CHECKING:
    import torch

__all__ = [
    "PAIR_KEYS",
    "WEIGHT_KEY",
    "DPOLoss",
    "PairsNeedBookkeepingError",
    "PreparedPairs",
    "SeenPairs",
    "dpo_losses",
    "dpo_losses_from_margins",
    "dpo_weights",
]

#: key of each row's DPO weight in a prepared batch (removed before the model sees the batch)
WEIGHT_KEY = "opake_dpo_weight"
#: keys of each row's pair id, role (+1 chosen, -1 rejected), reference log-probability (fp32
#: bits as int32, so that no cast of the batch's floating tensors rounds it) and the id of the
#: :meth:`DPOLoss.pairs` call that made the batch, in a batch weighed by the clipped forward
#: itself
PAIR_KEYS = ("opake_dpo_pair", "opake_dpo_role", "opake_dpo_reference", "opake_dpo_call")
_NOT_INPUTS = (WEIGHT_KEY, *PAIR_KEYS)


class SeenPairs(NamedTuple):
    """The pairs one forward weighed itself: their ids, margins, and the :meth:`DPOLoss.pairs`
    call they came from (diagnostics, **not private**)."""

    ids: torch.Tensor
    margins: torch.Tensor
    call: int


class PairsNeedBookkeepingError(ConfigurationError):
    """A batch of :meth:`DPOLoss.pairs` reached the loss one row at a time without its
    weight (the ``vmap`` engine): weigh it with :meth:`DPOLoss.prepare` instead."""


def _margins(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    chosen_ratio = chosen.float() - ref_chosen.float()
    return beta * (chosen_ratio - (rejected.float() - ref_rejected.float()))


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """Each pair's DPO loss ``[P]`` (TRL's ``loss_type="sigmoid"``) from the summed completion
    log-probabilities of the policy and the reference model.

    >>> import torch
    >>> round(float(dpo_losses(torch.tensor([-3.0]), torch.tensor([-3.0]),
    ...                        torch.tensor([-3.0]), torch.tensor([-3.0]), beta=0.1)[0]), 4)
    0.6931
    """
    import torch.nn.functional as F

    return -F.logsigmoid(_margins(chosen, rejected, ref_chosen, ref_rejected, beta))


def dpo_losses_from_margins(margins: torch.Tensor) -> torch.Tensor:
    """Each pair's DPO loss ``−log σ(m)`` from its reward margin ``m`` (:func:`dpo_losses`).

    >>> import torch
    >>> round(float(dpo_losses_from_margins(torch.zeros(1))[0]), 4)
    0.6931
    """
    import torch.nn.functional as F

    return -F.logsigmoid(margins.float())


def dpo_weights(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """``∂ℓ_i/∂π`` for each row ``[2P]`` (chosen rows, then rejected rows): ``−β σ(−m_i)`` and
    ``+β σ(−m_i)``, ``m_i`` the pair's margin. Bounded by ``β`` in absolute value.

    >>> import torch
    >>> w = dpo_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.2)
    >>> w.tolist()
    [-0.10000000149011612, 0.10000000149011612]
    """
    import torch

    scale = beta * torch.sigmoid(-_margins(chosen, rejected, ref_chosen, ref_rejected, beta))
    return torch.cat([-scale, scale])


@dataclass(frozen=True)
class PreparedPairs:
    """One physical batch of pairs, ready for ``accumulate(batch, units=units)``.

    Attributes:
        batch: the ``2P`` rows with each row's weight (:data:`WEIGHT_KEY`).
        units: ``[2P]`` int64: each row's privacy unit (its pair's id, the same for both rows).
        losses: ``[P]`` each pair's DPO loss (a diagnostic: **not private**).
        margins: ``[P]`` each pair's reward margin ``β·[(π_c − π_ref,c) − (π_r − π_ref,r)]``
            (a diagnostic: **not private**).
    """

    batch: dict[str, torch.Tensor]
    units: torch.Tensor
    losses: torch.Tensor
    margins: torch.Tensor


class DPOLoss:
    """The DPO loss of preference pairs for ``clipped_grad`` / ``DPTraining`` (see the module
    docstring): call :meth:`prepare` on each physical batch, then clip with
    ``units=prepared.units``; the object itself is the batched per-row loss
    ``fn(trainable, frozen, batch) -> [2P]`` for :class:`~opake.dpsgd.bookkeeping.BatchedLoss`.

    Args:
        fmodel: the ``fmodel`` of ``make_functional(model, partition_trainable=True)``.
        model: the model (PEFT or plain causal LM).
        beta: β, how far the policy may move from the reference (TRL's ``beta``).
        loss_only: take ``π`` from the patched model's loss-only head (no logits).
        autocast: a context factory for the forward (bf16); the losses are fp32.

    Example:
        >>> import torch
        >>> from opake.core.testing import tiny_llama
        >>> from opake.dpsgd.bookkeeping import BatchedLoss
        >>> from opake.dpsgd.clipping import clipped_grad
        >>> from opake.functional import make_functional
        >>> model = tiny_llama(hidden_size=16, num_hidden_layers=1, vocab_size=32,
        ...                    intermediate_size=32, seed=0)
        >>> fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        >>> dpo = DPOLoss(fmodel, model, beta=0.1)
        >>> rows = {"input_ids": torch.tensor([[3, 4, 5, 6], [3, 4, 9, 0]]),  # chosen, rejected
        ...         "labels": torch.tensor([[-100, -100, 5, 6], [-100, -100, 9, -100]])}
        >>> pairs = dpo.prepare(trainable, frozen, rows, ref_chosen=torch.tensor([-7.0]),
        ...                     ref_rejected=torch.tensor([-3.5]))
        >>> pairs.units.tolist(), tuple(pairs.losses.shape)
        ([0, 0], (1,))
        >>> grad_fn, state = clipped_grad(BatchedLoss(dpo, fmodel), clipping_norm=1.0,
        ...                               batch_argnums=2)
        >>> grads, state = grad_fn(trainable, frozen, pairs.batch, state=state,
        ...                        units=pairs.units)
        >>> float(grads.max_norm)
        1.0
    """

    def __init__(
        self,
        fmodel: Callable[..., Any],
        model: Any,
        *,
        beta: float = 0.1,
        loss_only: bool = False,
        autocast: Callable[[], Any] | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigurationError(
                f"DPOLoss got unknown keyword argument(s) {sorted(unknown)}; expected beta, "
                "loss_only, autocast"
            )
        if not callable(fmodel):
            raise InputTypeError(f"DPOLoss(fmodel={fmodel!r}): expected make_functional's fmodel")
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta > 0:
            raise ConfigurationError(f"DPOLoss(beta={beta!r}): expected a number > 0")
        self.fmodel = fmodel
        self.model = model
        self.beta = float(beta)
        self.loss_only = bool(loss_only)
        self._enter = autocast if autocast is not None else contextlib.nullcontext
        self.__name__ = "dpo_row_losses"
        #: the pairs each forward weighed itself (:class:`SeenPairs`: diagnostics, **not
        #: private**; drain it after each call)
        self.seen: list[SeenPairs] = []
        self._calls = 0

    def log_probs(
        self,
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Each row's summed log-probability of its completion tokens ``[R]`` (fp32)."""
        labels = batch["labels"]
        inputs: dict[str, Any] = {
            k: v for k, v in batch.items() if k != "labels" and k not in _NOT_INPUTS
        }
        params = (trainable, frozen)
        with self._enter():
            if self.loss_only:
                out = self.fmodel(
                    params,
                    **inputs,
                    labels=labels,
                    loss_only=True,
                    per_example_loss=True,
                    use_cache=False,
                )
                mean: torch.Tensor = out.loss.float()
                return -mean * target_counts(labels).to(mean.dtype)
            out = self.fmodel(params, **inputs, use_cache=False)
        return sequence_log_probs(out.logits, labels)

    def __call__(
        self,
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """``w_row · π_row`` for each row: differentiated per row, summed per pair (units)."""
        if PAIR_KEYS[0] in batch:
            if int(batch["input_ids"].shape[0]) > 1:
                return self._weighed_here(trainable, frozen, batch)
            return self._row_weight(batch) * self.log_probs(trainable, frozen, batch)
        weight = batch.get(WEIGHT_KEY)
        if weight is None:
            raise ConfigurationError(
                f"DPOLoss: the batch has no {WEIGHT_KEY!r}; pass the batch that "
                "DPOLoss.prepare(...) returned (each row's DPO weight), with its units"
            )
        return weight.float() * self.log_probs(trainable, frozen, batch)

    def _weighed_here(
        self,
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Rows of :meth:`pairs`: each weighed from its own pair's two log-probabilities of
        this forward (found by pair id); the margins are kept in :attr:`seen` for the engine's
        per-row checks of the same call."""
        import torch

        logp = self.log_probs(trainable, frozen, batch)
        pair, role, bits, call = (batch[key] for key in PAIR_KEYS)
        reference = bits.view(torch.float32)
        ids, group = torch.unique(pair, return_inverse=True)
        count = torch.zeros(ids.shape[0], device=logp.device).index_add_(
            0, group, torch.ones_like(logp)
        )
        roles = torch.zeros(ids.shape[0], device=logp.device).index_add_(0, group, role.float())
        if not (bool((count == 2).all()) and bool((roles == 0).all())):
            raise ConfigurationError(
                "DPOLoss: a microbatch holds a pair's chosen row without its rejected row (or "
                "a pair id twice): each pair's two rows must reach the loss together; clip "
                "with units= so that the engine keeps them in one microbatch"
            )
        ratio = role.float() * (logp.detach() - reference)
        margins = self.beta * torch.zeros_like(count).index_add_(0, group, ratio)
        self.seen.append(SeenPairs(ids.detach(), margins.detach(), int(call[0])))
        return -role.float() * self.beta * torch.sigmoid(-margins)[group] * logp

    def _row_weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weight of one row of :meth:`pairs` evaluated alone (the engine's per-row checks
        of a call): its pair's margin in a forward of the *same* :meth:`pairs` batch that saw
        both rows. Anything else raises :class:`PairsNeedBookkeepingError`: the ``vmap``
        engine (rows alone, no such forward) or a microbatch that split the pair."""
        import torch

        pair, role, call = batch[PAIR_KEYS[0]], batch[PAIR_KEYS[1]], batch[PAIR_KEYS[3]]
        try:
            key, made = int(pair.reshape(-1)[0]), int(call.reshape(-1)[0])
        except RuntimeError:  # a value under vmap: the rows are evaluated alone
            key, made, found = -1, -1, []
        else:
            found = [s for s in reversed(self.seen) if s.call == made]
        for seen in found:
            hit = seen.ids.eq(key).nonzero()
            if hit.numel():
                margin = seen.margins[int(hit[0, 0])].to(role.device)
                return -role.float().reshape(-1) * self.beta * torch.sigmoid(-margin)
        raise PairsNeedBookkeepingError(
            "DPOLoss: a row of DPOLoss.pairs(...) reached the loss alone, with no forward of "
            "both rows of its pair in this call to weigh it (the vmap engine evaluates rows "
            "alone; a microbatch must hold whole pairs: clip with units=); weigh the batch "
            "with DPOLoss.prepare(...) instead"
        )

    def prepare(
        self,
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        *,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
        ids: torch.Tensor | None = None,
    ) -> PreparedPairs:
        """Attach each row's DPO weight, from one policy forward without gradient.

        ``batch``: ``2P`` rows (chosen rows, then rejected rows); ``ref_chosen`` /
        ``ref_rejected``: ``[P]`` the reference model's summed completion log-probabilities
        (computed once beforehand, or for this batch); ``ids``: ``[P]`` each pair's privacy unit
        id (default ``0 .. P-1``; in a training loop, ids unique within the logical step, e.g.
        the dataset indices).
        """
        import torch

        pairs = _pair_count("prepare", batch, ref_chosen, ref_rejected)
        if pairs == 0:  # an empty Poisson batch: no forward (a model refuses zero rows)
            logp = torch.zeros(0, dtype=torch.float32, device=batch["input_ids"].device)
        else:
            with torch.no_grad():
                logp = self.log_probs(trainable, frozen, batch).detach()
        chosen, rejected = logp[:pairs], logp[pairs:]
        ref_c = ref_chosen.to(logp.device)
        ref_r = ref_rejected.to(logp.device)
        margins = _margins(chosen, rejected, ref_c, ref_r, self.beta)
        weights = dpo_weights(chosen, rejected, ref_c, ref_r, beta=self.beta)
        if ids is None:
            ids = torch.arange(pairs, device=logp.device)
        units = torch.cat([ids, ids]).to(device=logp.device, dtype=torch.int64)
        prepared = {k: v for k, v in batch.items() if k != WEIGHT_KEY}
        prepared[WEIGHT_KEY] = weights.to(logp.device)
        return PreparedPairs(
            batch=prepared,
            units=units,
            losses=dpo_losses(chosen, rejected, ref_c, ref_r, beta=self.beta),
            margins=margins,
        )

    def pairs(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
        ids: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``batch`` (``2P`` rows: chosen, then rejected) made ready to be weighed by the
        clipped forward itself, with the book-keeping engine: ``(batch, units)``, each row
        carrying its pair id (``ids``, default ``0 .. P-1``), role and reference
        log-probability (:data:`PAIR_KEYS`). Clip it with ``units=units``; the pairs' margins
        seen by each forward are appended to :attr:`seen` (diagnostics: **not private**).

        >>> import torch
        >>> from opake.core.testing import tiny_llama
        >>> from opake.dpsgd.bookkeeping import BatchedLoss
        >>> from opake.dpsgd.clipping import clipped_grad
        >>> from opake.functional import make_functional
        >>> model = tiny_llama(hidden_size=16, num_hidden_layers=1, vocab_size=32,
        ...                    intermediate_size=32, seed=0)
        >>> fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        >>> dpo = DPOLoss(fmodel, model, beta=0.1)
        >>> rows = {"input_ids": torch.tensor([[3, 4, 5, 6], [3, 4, 9, 0]]),
        ...         "labels": torch.tensor([[-100, -100, 5, 6], [-100, -100, 9, -100]])}
        >>> batch, units = dpo.pairs(rows, ref_chosen=torch.tensor([-7.0]),
        ...                          ref_rejected=torch.tensor([-3.5]))
        >>> grad_fn, state = clipped_grad(BatchedLoss(dpo, fmodel), clipping_norm=1.0,
        ...                               batch_argnums=2, engine="bookkeeping")
        >>> grads, state = grad_fn(trainable, frozen, batch, state=state, units=units)
        >>> float(grads.max_norm), len(dpo.seen)
        (1.0, 1)
        """
        import torch

        count = _pair_count("pairs", batch, ref_chosen, ref_rejected)
        rows = 2 * count
        device = batch["input_ids"].device
        if ids is None:
            ids = torch.arange(count, device=device)
        ids = ids.to(device=device, dtype=torch.int64)
        if tuple(ids.shape) != (count,) or torch.unique(ids).numel() != count:
            raise ConfigurationError(
                f"DPOLoss.pairs(ids=...): expected {count} distinct pair ids, one per pair"
            )
        units = torch.cat([ids, ids])
        ready = {k: v for k, v in batch.items() if k not in _NOT_INPUTS}
        ready[PAIR_KEYS[0]] = units
        ready[PAIR_KEYS[1]] = torch.cat(
            [torch.ones(count, device=device), -torch.ones(count, device=device)]
        )
        reference = torch.cat([ref_chosen, ref_rejected]).to(device=device, dtype=torch.float32)
        ready[PAIR_KEYS[2]] = reference.contiguous().view(torch.int32)
        self._calls += 1
        ready[PAIR_KEYS[3]] = torch.full((rows,), self._calls, dtype=torch.int64, device=device)
        return ready, units


def _pair_count(
    method: str,
    batch: Mapping[str, torch.Tensor],
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
) -> int:
    """``P`` for a batch of ``2P`` rows with ``[P]`` reference log-probabilities each side."""
    rows = int(batch["input_ids"].shape[0])
    if rows % 2:
        raise ConfigurationError(
            f"DPOLoss.{method}: {rows} rows; expected 2P rows (the P chosen sequences, then "
            "the P rejected ones, as TRL's DataCollatorForPreference lays them out)"
        )
    pairs = rows // 2
    for name, value in (("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected)):
        if tuple(value.shape) != (pairs,):
            raise ConfigurationError(
                f"DPOLoss.{method}({name}=...): shape {tuple(value.shape)}; expected "
                f"({pairs},), one reference log-probability per pair"
            )
    return pairs
