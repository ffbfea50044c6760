"""Book-keeping clipping: per-example norms without per-example gradients.

``clipped_grad(BatchedLoss(fn, fmodel), ..., engine="bookkeeping")`` (or the default
``engine="auto"``) computes the same clipped sum as the vmap engine from **one ordinary batched
forward and backward**: forward hooks keep each layer's input, an identity autograd node keeps
its output gradient, and the backward computes activation gradients only (no weight gradient,
no ``create_graph``). Per layer:

- ``nn.Linear`` (LoRA adapters included) and GPT-2's ``Conv1D`` over a sequence: the ghost
  identity ``‖Σ_t g_t x_tᵀ‖² = Σ_{t,s} (g_t·g_s)(x_t·x_s)`` or the materialised per-example
  gradient, whichever :func:`ghost_is_cheaper` says (``T·(d + p)`` vs ``d·p`` multiply-adds,
  per layer like fastDP's MixOpt);
- ``nn.Embedding``: index matching (``Σ_{t,s} [id_t = id_s] (e_t·e_s)``, padding index excluded);
- ``nn.LayerNorm`` / ``nn.RMSNorm`` weights and all biases directly;
- a leaf layer without a rule (e.g. a model's own RMSNorm class): its per-example gradient by
  ``vmap`` over that layer alone, checked to reproduce the batched output;
- a parameter read by several layers (GPT-2's tied ``wte``/``lm_head``): the sum of the uses,
  with every cross term;
- a parameter read without calling its layer — the ``lm_head`` weight handed to a linear
  cross-entropy kernel by a loss-only forward (``model(..., loss_only=True)`` after
  :func:`~opake.patches.apply_model_patches`): the forward asks :func:`implicit_use`, computes
  with the detached weight and taps the per-token losses; the per-example gradients are then
  held by an :class:`ImplicitGrad` operator (``opake.kernels.linear_cross_entropy_example_grads``,
  vocabulary tile by vocabulary tile: no logits tensor exists at any point).

The clipped sum ``Σ_i c_i ∇ℓ_i`` is then one contraction per layer of the recorded inputs and
the ``c_i``-scaled output gradients (fp32). The clip factors come from bounds that fp32
cancellation between tokens cannot shrink (``Σ_t ‖a_t‖‖b_t‖`` per example); an example whose
bound is loose is measured and added exactly, from its gradient materialised in fp64
(``opake.dpsgd.bookkeeping._certify``). The per-parameter norms of the example with the largest
non-zero gradient are compared with plain autograd on that example alone — on the first call,
on every new structure and periodically; ``"auto"`` falls back to vmap when anything is
unsupported or that check fails, ``"bookkeeping"`` raises, and a call where no example can be
compared runs on vmap. :func:`bookkeeping_plan` shows the rule of every layer.

Layer rules are a registry (:mod:`opake.dpsgd.bookkeeping.rules`, one module per kind of layer;
a plugin adds rules for its own layers through the ``opake_bookkeeping_rules`` hook):
:func:`registered_rules` lists them in the order they are tried.

The loss must return per-example losses for a batch (:class:`BatchedLoss`): reduce over each
example's tokens (:func:`causal_lm_losses`), never over the batch. The model must keep the
batch on dimension 0 of every hooked layer's input (an input of batch 1 broadcast over the
batch, like position ids, is handled). Non-reentrant activation checkpointing (Hugging Face's
``gradient_checkpointing_enable()``) works and is tested; a reentrant one, which runs layers
under ``no_grad``, raises.

>>> import torch
>>> from opake.dpsgd.clipping import clipped_grad
>>> from opake.dpsgd.bookkeeping import BatchedLoss
>>> from opake.functional import make_functional
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
>>> fmodel, params = make_functional(model)
>>> def losses(p, x, y):  # a batch in, [B] per-example losses out
...     return ((fmodel(p, x) - y) ** 2).sum(dim=1)
>>> loss_fn = BatchedLoss(losses, fmodel)
>>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2))
>>> x, y = torch.randn(4, 3), torch.randn(4, 2)
>>> grads, state = grad_fn(params, x, y, state=state)
>>> grad_fn.engine
'bookkeeping'
>>> vmap_fn, _ = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), engine="vmap")
>>> reference, _ = vmap_fn(params, x, y, state=state)
>>> all(torch.allclose(grads[k], reference[k], atol=1e-6) for k in grads)
True
"""

from __future__ import annotations

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._certify import CertifiedImplicitGrad, PieceCert, certify_inner
from opake.dpsgd.bookkeeping._certify import certify as certify_piece
from opake.dpsgd.bookkeeping._loss import BatchedLoss, causal_lm_losses
from opake.dpsgd.bookkeeping._pieces import Dense, ImplicitGrad, OuterSum, ghost_is_cheaper
from opake.dpsgd.bookkeeping._plan import BookkeepingPlan, bookkeeping_plan
from opake.dpsgd.bookkeeping._recording import ImplicitUse, implicit_use
from opake.dpsgd.bookkeeping._registry import registered_rules
from opake.dpsgd.bookkeeping._use import LayerRule, LayerUse, RuleExample

__all__ = [
    "BatchedLoss",
    "BookkeepingPlan",
    "BookkeepingRule",
    "CertifiedImplicitGrad",
    "Dense",
    "ImplicitGrad",
    "ImplicitUse",
    "LayerRule",
    "LayerUse",
    "OuterSum",
    "PieceCert",
    "RuleExample",
    "bookkeeping_plan",
    "causal_lm_losses",
    "certify_inner",
    "certify_piece",
    "ghost_is_cheaper",
    "implicit_use",
    "registered_rules",
]
