"""Level 2 of ``docs/design/fsdp2.md``: DP-SGD with per-layer sharded compute under FSDP2.

One logical step over a ``fully_shard``-ed module, on every rank::

    its Poisson shard, padded to the ranks' largest ──► the module's own forward: FSDP gathers
    one unit at a time; hooks record each layer's inputs a_i ──► one backward w.r.t. a sink:
    output gradients δ_i (no weight gradient, nothing for FSDP to reduce) ──► per-example norms
    from the records (certified bounds) ──► Σ_i c_i a_iᵀ δ_i per layer, full size, fp32, kept
    locally across physical batches ──► ShardedDPOptimizer.step: reduce-scatter (SUM, fp32,
    once) ──► + this rank's rows of ONE full-size draw ──► ÷ q·N ──► update the shards ──► account

No rank ever holds more than one unit's gathered parameters for the per-example work (level 1,
:func:`~opake.dpsgd.distributed.gather_full_params`, gathers the whole model). The second half
— agreement, reduce-scatter, noise rows, divisor, optimizer, accountant — is level 1's
:class:`~opake.dpsgd.distributed.ShardedDPOptimizer`. A step of one physical batch can pass
``reduce_scatter=True`` to its ``grad_fn`` call: each layer's sum is then reduce-scattered as
soon as it is formed and freed before the next (with one chunk per call, one full-size sum
alive at a time), and the step only adds the noise rows. Every call and every step first lines
the ranks up (one small all-gather): a rank that steps while another calls ``grad_fn`` once
more makes both raise.

- :func:`sharded_clipped_grad` — the ``grad_fn`` (:class:`ShardedClippedGradFn`);
- :func:`sharded_plan` — the rule of every layer; raises for a layer without a closed-form rule;
- :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint` — each rank writes its
  shards (``torch.distributed.checkpoint``), rank 0 the DP state once; resume on the same
  world size.

Example (the shape of a ``torchrun`` worker; ``build_model``, ``loader`` are yours)::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from opake.dpsgd.bookkeeping import causal_lm_losses
    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad

    model = build_model()                      # identical initial weights on every rank
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ShardedDPOptimizer(torch.optim.AdamW(model.parameters()), model,
                             noise_multiplier=sigma, seed=shared_seed, sampler=sampler)
    grad_fn, state = sharded_clipped_grad(
        lambda ids: causal_lm_losses(model(ids), ids), model, clipping_norm=1.0,
        microbatch_size=8)
    for idx in sampler:                        # this rank's share of the global batch
        for part in physical_batches(idx):     # the same count on every rank
            grads, state = grad_fn(ids[part], state=state)
            opt.accumulate(grads)              # full-size fp32 sums, kept locally
        opt.step()                             # reduce-scatter once, noise rows, update
    for idx in sampler:                        # or: one physical batch per step
        grads, state = grad_fn(ids[idx], state=state, reduce_scatter=True)
        opt.accumulate(grads)                  # this rank's rows, reduced as each was formed
        opt.step()                             # noise rows, update

>>> from opake.dpsgd.distributed.sharded import WEIGHT_FREE_RULES
>>> sorted(WEIGHT_FREE_RULES)
['conv1d', 'embedding', 'linear']
"""

from __future__ import annotations

from opake.dpsgd.distributed.sharded._api import sharded_clipped_grad
from opake.dpsgd.distributed.sharded._checkpoint import (
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from opake.dpsgd.distributed.sharded._grad_fn import ShardedClippedGradFn
from opake.dpsgd.distributed.sharded._plan import sharded_plan
from opake.dpsgd.distributed.sharded._runner import WEIGHT_FREE_RULES

__all__ = [
    "WEIGHT_FREE_RULES",
    "ShardedClippedGradFn",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
    "sharded_clipped_grad",
    "sharded_plan",
]
