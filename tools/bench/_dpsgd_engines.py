"""``dpsgd_step.py --engines``: four ways to compute per-example gradients, with plain torch.func.

Each way computes the per-example gradients of the trainable parameters (no clipping) of the
benchmark model; the fingerprint ``Σ_i ‖g_i‖²`` (fp64) lets the driver check that they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ENGINES = ("vmap-grad", "vmap-vjp", "expand-autograd", "loop")


def per_example_grads(
    model: Any, ids: Any, engine: str
) -> tuple[Callable[[], Any], Callable[[], float]]:
    """Per-example gradients of the trainable parameters, one way; and a result fingerprint."""
    import torch
    from torch.func import functional_call, grad, vjp, vmap

    named = list(model.named_parameters())
    params = {name: p.detach() for name, p in named if p.requires_grad}
    frozen = {name: p.detach() for name, p in named if not p.requires_grad}

    def loss(p: Any, x: Any) -> Any:
        kwargs = {"input_ids": x[None], "labels": x[None], "use_cache": False}
        return functional_call(model, (p, frozen), (), kwargs).loss

    def vmap_grad() -> Any:
        with torch.no_grad():
            return vmap(grad(loss), in_dims=(None, 0))(params, ids)

    def vmap_vjp() -> Any:
        def one(p: Any, x: Any) -> Any:
            value, pullback = vjp(lambda q: loss(q, x), p)[:2]
            return pullback(torch.ones_like(value))[0]

        with torch.no_grad():
            return vmap(one, in_dims=(None, 0))(params, ids)

    def expand_autograd() -> Any:
        leaves = {
            k: v.unsqueeze(0).expand(len(ids), *v.shape).requires_grad_() for k, v in params.items()
        }
        with torch.enable_grad():
            losses = vmap(loss, in_dims=(0, 0))(leaves, ids)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads, strict=True))

    def loop() -> Any:
        out: dict[str, list[Any]] = {k: [] for k in params}
        for i in range(len(ids)):
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            grads = torch.autograd.grad(loss(leaves, ids[i]), list(leaves.values()))
            for k, g in zip(leaves, grads, strict=True):
                out[k].append(g)
        return {k: torch.stack(v) for k, v in out.items()}

    fn: Callable[[], Any] = {
        "vmap-grad": vmap_grad,
        "vmap-vjp": vmap_vjp,
        "expand-autograd": expand_autograd,
        "loop": loop,
    }[engine]

    def fingerprint() -> float:
        return float(sum(g.double().square().sum() for g in fn().values()))

    return fn, fingerprint
