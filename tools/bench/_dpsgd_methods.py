"""The training steps ``dpsgd_step.py`` times: non-private, Opake's (three ways) and Opacus's.

Each ``*_step`` function returns ``(step, clipped)``: ``step()`` runs one training step,
``clipped()`` (``--check``) returns the clipped sum of one step before noise, parameter name ->
tensor. Opake is imported when a method is built, from whichever tree ``PYTHONPATH`` names
(``--baseline``): only Opake's public API is used, in the form that tree accepts.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

from _dpsgd_workload import BENCH, LR, SIGMA, Workload

METHODS = (
    "nonprivate",
    "opake",
    "opake-bk",
    "opake-user",
    "opake-user-vmap",
    "opake-user-bk",
    "opacus-hooks",
    "opacus-ghost",
)
# the documented user path with each engine forced (to measure what "auto" should choose)
USER_ENGINES = {"opake-user": "auto", "opake-user-vmap": "vmap", "opake-user-bk": "bookkeeping"}
Step = Callable[[], None]
# Clipped sum of one step: parameter name -> fp32 tensor (no noise), for --check.
Clipped = Callable[[], dict[str, Any]]


def engine_option(engine: str) -> dict[str, Any]:
    """The keyword that picks the clipping engine in the imported tree's ``clipped_grad``:
    ``engine=`` — or ``method=``, its name before the rename (a ``--baseline`` tree from
    before it rejects ``engine=``)."""
    from opake.dpsgd.clipping import clipped_grad

    parameters = inspect.signature(clipped_grad).parameters
    for name in ("engine", "method"):
        if name in parameters:
            return {name: engine}
    raise SystemExit(f"clipped_grad{inspect.signature(clipped_grad)}: no engine= nor method=")


def _dp_optimizer(model: Any, trainable: Any, work: Workload) -> Any:
    import torch

    from opake.dpsgd.optimizer import DPOptimizer

    return DPOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
        trainable,
        noise_multiplier=SIGMA,
        expected_batch_size=float(work.batch),
        seed=0,
        unused_params="warn",
    )


def nonprivate_step(model: Any, ids: Any) -> tuple[Step, Clipped | None]:
    """``model(input_ids, labels).loss.backward()``, ``optimizer.step()``."""
    import torch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    return step, None


def opake_step(
    model: Any,
    ids: Any,
    args: argparse.Namespace,
    work: Workload = BENCH,
    *,
    engine: str = "vmap",
) -> tuple[Step, Clipped]:
    """One Opake DP step: ``clipped_grad`` with ``engine`` ("vmap": the one-example loss;
    "bookkeeping": a ``BatchedLoss``), then ``DPOptimizer`` (noise once, SGD)."""
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(trainable: Any, frozen: Any, input_ids: Any, labels: Any) -> Any:  # [SEQ]
        out = fmodel(
            (trainable, frozen), input_ids=input_ids[None], labels=labels[None], use_cache=False
        )
        return out.loss

    def losses(trainable: Any, frozen: Any, input_ids: Any, labels: Any) -> Any:  # [B]
        out = fmodel((trainable, frozen), input_ids=input_ids, use_cache=False)
        return causal_lm_losses(out.logits, labels)

    grad_fn, clip_state = clipped_grad(
        loss_fn if engine == "vmap" else BatchedLoss(losses, fmodel),
        clipping_norm=work.clip,
        batch_argnums=(2, 3),
        microbatch_size=args.microbatch_size,
        **engine_option(engine),
    )
    opt = _dp_optimizer(model, trainable, work)
    state = {"clip": clip_state}

    def step() -> None:
        grads, state["clip"] = grad_fn(trainable, frozen, ids, ids, state=state["clip"])
        opt.accumulate(grads)
        opt.step()

    def clipped() -> dict[str, Any]:
        return dict(grad_fn(trainable, frozen, ids, ids, state=state["clip"])[0])

    return step, clipped


def opake_user_step(
    model: Any, ids: Any, args: argparse.Namespace, work: Workload, engine: str
) -> tuple[Step, Clipped]:
    """The documented path: patched model, loss-only ``BatchedLoss`` closing over the frozen
    weights, ``clipped_grad(engine=engine)``, then ``DPOptimizer``."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional
    from opake.patches import apply_model_patches

    apply_model_patches(model, chunked_linear_cross_entropy=True)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def losses(p: Any, input_ids: Any) -> Any:  # [B]: no logits, frozen weights closed over
        out = fmodel(
            (p, frozen),
            input_ids=input_ids,
            labels=input_ids,
            loss_only=True,
            per_example_loss=True,
            use_cache=False,
        )
        return out.loss

    grad_fn, clip_state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=work.clip,
        batch_argnums=1,
        microbatch_size=args.microbatch_size,
        **engine_option(engine),
    )
    opt = _dp_optimizer(model, trainable, work)
    state = {"clip": clip_state}

    def step() -> None:
        # like the non-private step: the last step's .grad goes before the forward, so it is
        # not held (a gradient-sized buffer) through the next clipped_grad
        opt.zero_grad(set_to_none=True)
        grads, state["clip"] = grad_fn(trainable, ids, state=state["clip"])
        opt.accumulate(grads)
        del grads  # the optimizer holds its own copy
        opt.step()

    def clipped() -> dict[str, Any]:
        return dict(grad_fn(trainable, ids, state=state["clip"])[0])

    return step, clipped


def _named_trainable(wrapped: Any) -> list[tuple[str, Any]]:
    return [
        (name.removeprefix("_module."), p)
        for name, p in wrapped.named_parameters()
        if p.requires_grad
    ]


def opacus_step(model: Any, ids: Any, ghost: bool, work: Workload = BENCH) -> tuple[Step, Clipped]:
    """Opacus's ``GradSampleModule`` (per-sample gradient hooks), or its ghost clipping."""
    import torch
    from opacus import PrivacyEngine

    data = torch.utils.data.TensorDataset(ids)
    loader = torch.utils.data.DataLoader(data, batch_size=work.batch)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine = PrivacyEngine()
    if ghost:
        return _opacus_ghost(engine, model, opt, loader, ids, work)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=work.clip,
        poisson_sampling=False,
    )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    def clipped() -> dict[str, Any]:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.clip_and_accumulate()  # per-sample gradients -> clipped sum in .summed_grad
        return {name: p.summed_grad.detach().clone() for name, p in _named_trainable(model)}

    return step, clipped


def _opacus_ghost(
    engine: Any, model: Any, opt: Any, loader: Any, ids: Any, work: Workload
) -> tuple[Step, Clipped]:
    import torch

    vocab = int(model.config.vocab_size)
    criterion = torch.nn.CrossEntropyLoss()
    model, opt, criterion, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        criterion=criterion,
        noise_multiplier=SIGMA,
        max_grad_norm=work.clip,
        grad_sample_mode="ghost",
        poisson_sampling=False,
    )

    def backward() -> None:
        # Opacus's loss wrapper runs both passes: per-example norms (ghost identity for
        # linear layers and embeddings, per-sample gradients for the rest), then the
        # backward of Σ_i c_i ℓ_i, which leaves the clipped sum in .grad.
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        shape = logits.shape  # per-sequence privacy unit: Opacus needs [B, T, V]
        loss = criterion(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), shape=shape)
        loss.backward()

    def step() -> None:
        backward()
        opt.step()

    def clipped() -> dict[str, Any]:
        backward()
        return {name: p.grad.detach().clone() for name, p in _named_trainable(model)}

    return step, clipped


def method_step(
    method: str, model: Any, ids: Any, args: argparse.Namespace, work: Workload
) -> tuple[Step, Clipped | None]:
    """The ``(step, clipped)`` pair of one of :data:`METHODS`."""
    if method == "nonprivate":
        return nonprivate_step(model, ids)
    if method == "opake":
        return opake_step(model, ids, args, work)
    if method == "opake-bk":
        return opake_step(model, ids, args, work, engine="bookkeeping")
    if method in USER_ENGINES:
        return opake_user_step(model, ids, args, work, USER_ENGINES[method])
    if method in ("opacus-hooks", "opacus-ghost"):
        return opacus_step(model, ids, method == "opacus-ghost", work)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
