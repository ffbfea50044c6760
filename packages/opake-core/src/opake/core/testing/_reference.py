"""The slow, obvious oracle: per-example gradients by a Python loop of plain autograd."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "assert_grads_close",
    "per_example_grads_loop",
    "reference_clipped_grad",
    "reference_clipped_sum",
]


def _example(value: object, i: int) -> object:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x[i] if isinstance(x, torch.Tensor) else x, value)


def per_example_grads_loop(
    loss_fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    argnums: int = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Per-example gradients, one example at a time, with ``torch.autograd.grad``.

    ``loss_fn`` sees one example (the batch arguments indexed with ``[i]``, no batch
    dimension), exactly like under :func:`opake.dpsgd.clipping.clipped_grad`. Returns the list
    of gradient dicts (a parameter the loss does not use gets zeros) and the list of losses.

    >>> import torch
    >>> grads, losses = per_example_grads_loop(
    ...     lambda p, x: (p["w"] * x).sum(), ({"w": torch.zeros(2)}, torch.eye(2))
    ... )
    >>> [g["w"].tolist() for g in grads]
    [[1.0, 0.0], [0.0, 1.0]]
    """
    import torch
    from torch.utils._pytree import tree_leaves

    batch = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    first = next(x for x in tree_leaves(args[batch[0]]) if isinstance(x, torch.Tensor))
    grads: list[dict[str, torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    for i in range(int(first.shape[0])):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args[argnums].items()}
        call = [_example(a, i) if pos in batch else a for pos, a in enumerate(args)]
        call[argnums] = leaves
        with torch.enable_grad():
            out = loss_fn(*call)
            loss = out[0] if has_aux else out
            got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads.append(
            {
                k: torch.zeros_like(v) if g is None else g.detach()
                for (k, v), g in zip(leaves.items(), got, strict=True)
            }
        )
        losses.append(loss.detach())
    return grads, losses


def reference_clipped_sum(
    per_example: Sequence[Mapping[str, torch.Tensor]],
    *,
    clipping_norm: float | Mapping[str, float] | Any,
    groups: Mapping[str, str] | None = None,
    example_mask: Sequence[bool] | None = None,
    normalize_by: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Clip each example and sum, in float64, with the textbook formulas.

    ``clipping_norm`` is a float C (scale ``min(1, C/(‖g‖+1e-6))``), a mapping group → C_k
    with ``groups`` mapping every parameter name to its group (each group clipped on its
    own), or a clip state object from :mod:`opake.dpsgd.clipping` (``AutoSClipping`` scales by
    ``R/(‖g‖+γ)``; ``FixedClipping`` and ``AdaptiveClipping`` clip at their current C).
    Examples with a non-finite gradient, and those whose ``example_mask`` entry is false, are
    skipped.

    >>> import torch
    >>> out = reference_clipped_sum([{"w": torch.tensor([3.0, 4.0])}], clipping_norm=1.0)
    >>> [round(v, 4) for v in out["w"].tolist()]
    [0.6, 0.8]
    """
    import torch

    spec: Any = clipping_norm
    kind = getattr(spec, "kind", None)
    if kind == "group":
        clipping_norm = dict(spec.clipping_norms)
    elif kind in {"fixed", "adaptive"}:
        clipping_norm = spec.clipping_norm
    if not per_example:
        raise ConfigurationError("reference_clipped_sum: no examples; nothing to compare with")
    total = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in per_example[0].items()}
    for i, grads in enumerate(per_example):
        if example_mask is not None and not example_mask[i]:
            continue
        g64 = {k: v.detach().to(torch.float64).cpu() for k, v in grads.items()}
        if not all(bool(torch.isfinite(v).all()) for v in g64.values()):
            continue
        norm = math.sqrt(sum(float((v * v).sum()) for v in g64.values()))
        if kind == "auto_s":
            scale = spec.clipping_norm / (norm + spec.stability)
            factor = dict.fromkeys(g64, scale)
        elif isinstance(clipping_norm, Mapping):
            if groups is None:
                raise ConfigurationError("reference_clipped_sum: group bounds need groups=")
            group_norm = {
                g: math.sqrt(sum(float((v * v).sum()) for k, v in g64.items() if groups[k] == g))
                for g in clipping_norm
            }
            factor = {
                k: min(1.0, clipping_norm[groups[k]] / (group_norm[groups[k]] + 1e-6)) for k in g64
            }
        else:
            factor = {k: min(1.0, float(clipping_norm) / (norm + 1e-6)) for k in g64}
        for k, v in g64.items():
            total[k] += factor[k] * v
    return {k: v / normalize_by for k, v in total.items()}


def reference_clipped_grad(
    loss_fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    clipping_norm: float | Mapping[str, float] | Any,
    argnums: int = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    groups: Mapping[str, str] | None = None,
    example_mask: Sequence[bool] | None = None,
    normalize_by: float = 1.0,
) -> dict[str, torch.Tensor]:
    """:func:`per_example_grads_loop` then :func:`reference_clipped_sum` (float64 result).

    >>> import torch
    >>> out = reference_clipped_grad(
    ...     lambda p, x: (p["w"] * x).sum(), ({"w": torch.zeros(2)}, 10 * torch.eye(2)),
    ...     clipping_norm=1.0,
    ... )
    >>> [round(v, 4) for v in out["w"].tolist()]
    [1.0, 1.0]
    """
    grads, _ = per_example_grads_loop(
        loss_fn, args, argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux
    )
    return reference_clipped_sum(
        grads,
        clipping_norm=clipping_norm,
        groups=groups,
        example_mask=example_mask,
        normalize_by=normalize_by,
    )


def assert_grads_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 0.0,
) -> None:
    """Assert same keys and, per tensor, ``max|a − e| ≤ rtol · max|e| + atol`` (in float64).

    The error is relative to the tensor's largest entry, the right scale for a sum of clipped
    gradients (entry-wise relative error is meaningless for entries near zero). When the sum
    cancels (contributions of both signs), pass ``atol`` ≈ ``rtol · batch · C``: rounding is
    relative to the summands, not to the sum. With ``atol=0`` an all-zero tensor must match
    exactly.

    >>> import torch
    >>> assert_grads_close({"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([1.0, 1e-9])})
    """
    import torch

    if set(actual) != set(expected):
        raise AssertionError(f"keys differ: {sorted(set(actual) ^ set(expected))}")
    for name, want in expected.items():
        got = actual[name]
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        got64 = got.detach().to(torch.float64).cpu()
        want64 = want.detach().to(torch.float64).cpu()
        scale = float(want64.abs().max()) if want64.numel() else 0.0
        err = float((got64 - want64).abs().max()) if want64.numel() else 0.0
        if not err <= rtol * scale + atol:
            raise AssertionError(
                f"{name}: max abs error {err:.3g} exceeds rtol {rtol:g} × max|expected| "
                f"{scale:.3g} + atol {atol:.3g}"
            )
