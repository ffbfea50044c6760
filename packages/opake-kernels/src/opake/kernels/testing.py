"""Check a kernel backend against the ``torch`` reference (values, gradients, per-example grads).

The per-example oracle is the slow obvious one: a Python loop over examples with plain
``torch.autograd.grad``. :func:`check_backend` runs every op a backend provides on small inputs
(ignored tokens, an all-ignored example, a vocabulary that is not a multiple of any power-of-two
tile, every logit transform) and raises ``AssertionError`` naming the first mismatch. Third-party
backends use it in their own test suites; the GPU check script uses it on CUDA.

>>> import torch
>>> from opake.kernels.testing import check_backend
>>> report = check_backend("chunked", ops=("swiglu",), dtypes=(torch.float32,))
>>> report[0]
'swiglu torch.float32 silu: values, grads, vmap per-example grads ok'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import grad, vmap

from opake.core import ops
from opake.core.plugins import kernel_backends

__all__ = [
    "Sizes",
    "check_backend",
    "loop_grads",
    "reference",
    "reference_example_grads",
    "tolerances",
    "vmap_grads",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Sizes:
    """Input sizes used by :func:`check_backend` (small by default: CPU and interpreter)."""

    batch: int = 3
    tokens: int = 8
    hidden: int = 32
    vocab: int = 90
    heads: int = 2
    head_dim: int = 16


@dataclass
class _Ctx:
    """What every per-op check needs: the two implementations and the case."""

    impl: Callable[..., Tensor]
    ref: Callable[..., Tensor]
    sizes: Sizes
    dtype: torch.dtype
    device: str
    gen: torch.Generator
    report: list[str]


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` for comparing a kernel with the reference at *dtype*.

    >>> tolerances(torch.float32)
    {'rtol': 0.0001, 'atol': 2e-05}
    """
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 2e-5}
    if dtype == torch.float16:
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 4e-2, "atol": 4e-2}


def loop_grads(
    fn: Callable[..., Tensor],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    batched: tuple[int, ...],
) -> tuple[Tensor, ...]:
    """Per-example gradients the slow obvious way: one plain autograd call per example.

    ``args[i]`` for ``i`` in *batched* has the examples on dim 0; the others are shared.
    Returns one stacked ``(batch, ...)`` tensor per index in *argnums*.
    """
    n = next(args[i] for i in batched).shape[0]
    out: list[list[Tensor]] = [[] for _ in argnums]
    for b in range(n):
        ex = [a[b] if i in batched else a for i, a in enumerate(args)]
        leaves = [ex[i].detach().clone().requires_grad_(True) for i in argnums]
        for k, i in enumerate(argnums):
            ex[i] = leaves[k]
        grads = torch.autograd.grad(fn(*ex), leaves, allow_unused=True)
        for k, g in enumerate(grads):
            out[k].append(torch.zeros_like(leaves[k]) if g is None else g)
    return tuple(torch.stack(g) for g in out)


def vmap_grads(
    fn: Callable[..., Tensor],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    batched: tuple[int, ...],
) -> tuple[Tensor, ...]:
    """Per-example gradients through ``vmap(grad(fn, argnums), in_dims)``."""
    in_dims = tuple(0 if i in batched else None for i in range(len(args)))
    with torch.no_grad():
        res = vmap(grad(fn, argnums=argnums), in_dims=in_dims)(*args)
    return tuple(res)


def _close(what: str, got: Tensor | None, want: Tensor | None, dtype: torch.dtype) -> None:
    if got is None or want is None:
        if got is not want:
            raise AssertionError(f"{what}: one side has no gradient ({got!r} vs {want!r})")
        return
    if not torch.isfinite(got).all():
        raise AssertionError(f"{what}: non-finite values")
    try:
        tol = tolerances(dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"], atol=tol["atol"])
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


def _compare(
    label: str,
    impl: Callable[..., Tensor],
    ref: Callable[..., Tensor],
    args: list[Any],
    *,
    argnums: tuple[int, ...],
    batched: tuple[int, ...],
    dtype: torch.dtype,
    reduce_out: Callable[[Tensor], Tensor],
) -> None:
    """Values, plain-autograd grads and vmap per-example grads of *impl* against *ref*."""
    _close(f"{label} values", impl(*args), ref(*args), dtype)
    leaves = [a.detach().clone().requires_grad_(True) for a in (args[i] for i in argnums)]
    full = list(args)
    for k, i in enumerate(argnums):
        full[i] = leaves[k]
    got = torch.autograd.grad(reduce_out(impl(*full)), leaves)
    want = torch.autograd.grad(reduce_out(ref(*full)), leaves)
    for k, i in enumerate(argnums):
        _close(f"{label} grad of arg {i}", got[k], want[k], dtype)

    def one(*a: Any) -> Tensor:
        return reduce_out(impl(*a))

    def one_ref(*a: Any) -> Tensor:
        return reduce_out(ref(*a))

    per_vmap = vmap_grads(one, args, argnums, batched)
    per_loop = loop_grads(one_ref, args, argnums, batched)
    for k, i in enumerate(argnums):
        _close(f"{label} vmap per-example grad of arg {i}", per_vmap[k], per_loop[k], dtype)


def _lce_inputs(s: Sizes, dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Tensor]:
    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    labels = torch.randint(0, s.vocab, (s.batch, s.tokens), generator=gen)
    labels[0, 1] = -100
    labels[-1, :] = -100  # an all-ignored example: loss 0, gradient 0
    return [
        rnd(s.batch, s.tokens, s.hidden),
        rnd(s.vocab, s.hidden, scale=s.hidden**-0.5),
        rnd(s.vocab, scale=0.1),
        labels.to(device),
    ]


_LCE_OPTIONS: tuple[dict[str, Any], ...] = (
    {},
    {"logit_scale": 0.7, "softcap": 1.5, "label_smoothing": 0.1},
    {"logit_divisor": 2.0, "label_smoothing": 0.05},
)


def _check_lce(c: _Ctx) -> None:
    impl, ref, s, dtype, device, gen = c.impl, c.ref, c.sizes, c.dtype, c.device, c.gen
    h, w, b, y = _lce_inputs(s, dtype, device, gen)
    for opts in _LCE_OPTIONS:
        for reduction in ("mean", "sum", "none", "per_example"):
            _close(
                f"linear_cross_entropy {dtype} {opts} reduction={reduction}",
                impl(h, w, y, bias=b, reduction=reduction, **opts),
                ref(h, w, y, bias=b, reduction=reduction, **opts),
                dtype,
            )

        def f(hh: Tensor, ww: Tensor, bb: Tensor, yy: Tensor, o: Any = opts) -> Tensor:
            return impl(hh, ww, yy, bias=bb, **o)

        def f_ref(hh: Tensor, ww: Tensor, bb: Tensor, yy: Tensor, o: Any = opts) -> Tensor:
            return ref(hh, ww, yy, bias=bb, **o)

        label = f"linear_cross_entropy {dtype} {opts}"
        _compare(
            label, f, f_ref, [h, w, b, y], argnums=(0, 1, 2), batched=(0, 3), dtype=dtype,
            reduce_out=_identity,
        )  # fmt: skip
    # per-example weights under vmap (weight batched, e.g. an ensemble): one call per example
    wb = torch.stack([w * (1.0 + 0.25 * i) for i in range(s.batch)])

    def g(hh: Tensor, ww: Tensor, yy: Tensor) -> Tensor:
        return impl(hh, ww, yy, softcap=2.0)

    def g_ref(hh: Tensor, ww: Tensor, yy: Tensor) -> Tensor:
        return ref(hh, ww, yy, softcap=2.0)

    per_vmap = vmap_grads(g, [h, wb, y], (0, 1), (0, 1, 2))
    per_loop = loop_grads(g_ref, [h, wb, y], (0, 1), (0, 1, 2))
    for k in range(2):
        what = f"linear_cross_entropy {dtype} batched weight, arg {k}"
        _close(what, per_vmap[k], per_loop[k], dtype)
    c.report.append(
        f"linear_cross_entropy {dtype}: values (4 reductions x {len(_LCE_OPTIONS)} option sets), "
        "grads, vmap per-example grads (shared and batched weight) ok"
    )


def _check_ce(c: _Ctx) -> None:
    impl, ref, s, dtype, device, gen = c.impl, c.ref, c.sizes, c.dtype, c.device, c.gen
    _h, _w, _b, y = _lce_inputs(s, dtype, device, gen)
    x = (torch.randn(s.batch, s.tokens, s.vocab, generator=gen) * 2).to(device=device, dtype=dtype)
    for opts in _LCE_OPTIONS:
        for reduction in ("mean", "sum", "none", "per_example"):
            _close(
                f"cross_entropy {dtype} {opts} reduction={reduction}",
                impl(x, y, reduction=reduction, **opts),
                ref(x, y, reduction=reduction, **opts),
                dtype,
            )

        def f(xx: Tensor, yy: Tensor, o: Any = opts) -> Tensor:
            return impl(xx, yy, **o)

        def f_ref(xx: Tensor, yy: Tensor, o: Any = opts) -> Tensor:
            return ref(xx, yy, **o)

        _compare(
            f"cross_entropy {dtype} {opts}", f, f_ref, [x, y], argnums=(0,), batched=(0, 1),
            dtype=dtype, reduce_out=_identity,
        )  # fmt: skip
    c.report.append(f"cross_entropy {dtype}: values, grads, vmap per-example grads ok")


def _identity(t: Tensor) -> Tensor:
    return t


def _weighted_sum(
    gen: torch.Generator, shape: tuple[int, ...], device: str
) -> Callable[[Tensor], Tensor]:
    r = torch.randn(*shape, generator=gen).to(device)

    def reduce_out(t: Tensor) -> Tensor:
        # the whole batch outside vmap; one example (weights r[0]) inside vmap and in the loop
        return (t.float() * (r if t.dim() == r.dim() else r[0])).sum()

    return reduce_out


def _check_rms(c: _Ctx) -> None:
    impl, ref, s, dtype, device, gen = c.impl, c.ref, c.sizes, c.dtype, c.device, c.gen
    x = (torch.randn(s.batch, s.tokens, s.hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(s.hidden, generator=gen)).to(device=device, dtype=dtype)
    red = _weighted_sum(gen, (s.batch, s.tokens, s.hidden), device)
    for offset in (0.0, 1.0):

        def f(xx: Tensor, ww: Tensor, o: float = offset) -> Tensor:
            return impl(xx, ww, eps=1e-6, offset=o)

        def f_ref(xx: Tensor, ww: Tensor, o: float = offset) -> Tensor:
            return ref(xx, ww, eps=1e-6, offset=o)

        _compare(
            f"rms_norm {dtype} offset={offset}", f, f_ref, [x, w], argnums=(0, 1), batched=(0,),
            dtype=dtype, reduce_out=red,
        )  # fmt: skip
    _close(f"rms_norm {dtype} weight=None", impl(x, None), ref(x, None), dtype)
    c.report.append(f"rms_norm {dtype}: values, grads, vmap per-example grads ok")


def _check_gated(c: _Ctx, op: str) -> None:
    impl, ref, s, dtype, device, gen = c.impl, c.ref, c.sizes, c.dtype, c.device, c.gen
    shape = (s.batch, s.tokens, s.hidden)
    a = (torch.randn(*shape, generator=gen) * 2).to(device=device, dtype=dtype)
    u = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    red = _weighted_sum(gen, shape, device)
    kinds: tuple[dict[str, Any], ...] = ({},) if op == ops.SWIGLU else ({}, {"approximate": "tanh"})
    for kw in kinds:

        def f(aa: Tensor, uu: Tensor, k: Any = kw) -> Tensor:
            return impl(aa, uu, **k)

        def f_ref(aa: Tensor, uu: Tensor, k: Any = kw) -> Tensor:
            return ref(aa, uu, **k)

        name = "silu" if op == ops.SWIGLU else kw.get("approximate", "none")
        _compare(
            f"{op} {dtype} {name}", f, f_ref, [a, u], argnums=(0, 1), batched=(0, 1),
            dtype=dtype, reduce_out=red,
        )  # fmt: skip
        c.report.append(f"{op} {dtype} {name}: values, grads, vmap per-example grads ok")


def _check_rope(c: _Ctx) -> None:
    impl, ref, s, dtype, device, gen = c.impl, c.ref, c.sizes, c.dtype, c.device, c.gen
    shape = (s.batch, s.heads, s.tokens, s.head_dim)
    x = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    ang = torch.randn(s.tokens, s.head_dim // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device=device, dtype=dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device=device, dtype=dtype)
    red = _weighted_sum(gen, shape, device)
    _compare(
        f"rope {dtype}", impl, ref, [x, cos, sin], argnums=(0,), batched=(0,), dtype=dtype,
        reduce_out=red,
    )  # fmt: skip
    # per-example tables (batched cos/sin of shape (batch, 1, tokens, head_dim))
    cb = cos.expand(s.batch, 1, *cos.shape).contiguous()
    sb = sin.expand(s.batch, 1, *sin.shape).contiguous()
    _compare(
        f"rope {dtype} batched tables", impl, ref, [x, cb, sb], argnums=(0,),
        batched=(0, 1, 2), dtype=dtype, reduce_out=red,
    )  # fmt: skip
    c.report.append(f"rope {dtype}: values, grads, vmap per-example grads ok")


def _check_clip(c: _Ctx) -> None:
    """Factors in [0, 1], a zero-factor example full of NaN/Inf, leaves across block edges."""
    impl, ref, dtype, device, gen = c.impl, c.ref, c.dtype, c.device, c.gen
    m, shapes = c.sizes.batch + 1, [(3,), (5, 7), (2, 513)]
    grads = [
        torch.randn(m, *shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes
    ]
    grads[0][1, 0] = float("nan")
    grads[1][-1].fill_(float("inf"))
    grads[2][-1, 0, 0] = float("nan")
    factors = torch.rand(m, len(shapes), generator=gen)
    factors[-1] = 0.0  # an example that must not contribute, whatever it holds
    factors = factors.to(device)
    start = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
    got, want = [t.clone() for t in start], [t.clone() for t in start]
    impl(grads, factors, got)
    ref(grads, factors, want)
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        _close(f"clip_accumulate {dtype} leaf {j}", a, b, torch.float32)
    c.report.append(f"clip_accumulate {dtype}: values (NaN/Inf rows, zero factors) ok")


_CHECKS: dict[str, Callable[[_Ctx], None]] = {
    ops.LINEAR_CROSS_ENTROPY: _check_lce,
    ops.CROSS_ENTROPY: _check_ce,
    ops.RMS_NORM: _check_rms,
    ops.SWIGLU: lambda c: _check_gated(c, ops.SWIGLU),
    ops.GEGLU: lambda c: _check_gated(c, ops.GEGLU),
    ops.ROPE: _check_rope,
    ops.CLIP_ACCUMULATE: _check_clip,
}


def reference_example_grads(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_grads: Tensor,
    *,
    bias: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor | None]:
    """The oracle of the implicit per-example gradient ops, explicitly: ``[B, V, H]`` and
    ``[B, V]`` (or ``None``), example ``i``'s gradient of ``Σ_t token_grads[i, t] · loss[i, t]``
    by plain autograd through the ``torch`` reference loss, one example at a time.

    >>> h, w = torch.ones(2, 3, 4), torch.zeros(5, 4)
    >>> y, g = torch.tensor([[0, 1, 2], [3, 4, -100]]), torch.ones(2, 3)
    >>> gw, gb = reference_example_grads(h, w, y, g)
    >>> [round(x, 4) for x in gw.square().sum((1, 2)).tolist()], gb
    ([4.8, 4.8], None)
    """
    loss = kernel_backends()["torch"].load_op(ops.LINEAR_CROSS_ENTROPY)
    gws: list[Tensor] = []
    gbs: list[Tensor] = []
    for i in range(hidden.shape[0]):
        w = weight.detach().clone().requires_grad_(True)
        b = None if bias is None else bias.detach().clone().requires_grad_(True)
        tok = loss(hidden[i], w, labels[i], bias=b, reduction="none", **options)
        leaves = [w] if b is None else [w, b]
        got = torch.autograd.grad((tok * token_grads[i]).sum(), leaves)
        gws.append(got[0])
        if b is not None:
            gbs.append(got[1])
    return torch.stack(gws), (torch.stack(gbs) if gbs else None)


def reference(op: str) -> Callable[..., Any]:
    """The reference implementation of a contract op (:mod:`opake.core.ops`): the ``torch``
    backend's, or :func:`reference_example_grads` for the implicit per-example gradient ops.

    >>> reference("rms_norm").__module__
    'opake.kernels.torch._reference'
    """
    if op in (ops.LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS, ops.LINEAR_CROSS_ENTROPY_RECORDED):
        return reference_example_grads
    ref = kernel_backends()["torch"]
    if op not in ref.ops:
        raise KeyError(f"{op!r} is not an op of the contract opake.core.ops ({ops.ALL_OPS})")
    return ref.load_op(op)


def check_backend(
    backend: str,
    *,
    ops: Sequence[str] | None = None,
    device: str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16),
    sizes: Sizes | None = None,
    seed: int = 0,
) -> list[str]:
    """Compare *backend*'s ops with the ``torch`` reference; return what was checked.

    For each op and dtype: forward values for every reduction/option, gradients by plain
    autograd, and per-example gradients under ``vmap(grad(...))`` against a per-example loop
    (with shared parameters, and for linear cross-entropy also with per-example weights).
    Raises ``AssertionError`` naming the op, dtype, options and argument on the first mismatch.
    """
    backends = kernel_backends()
    be = backends[backend]
    ref = backends["torch"]
    s = sizes or Sizes()
    report: list[str] = []
    # ops the reference lacks (the chunked backend's example-grads op) have their own tests
    chosen = tuple(op for op in be.ops if op in ref.ops) if ops is None else tuple(ops)
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(seed)
        for op in chosen:
            if op not in ref.ops:
                report.append(f"{op}: the torch reference has no such op (skipped)")
                continue
            check = _CHECKS.get(op)
            if check is None:
                report.append(f"{op}: no reference check known for this op (skipped)")
                continue
            check(_Ctx(be.load_op(op), ref.load_op(op), s, dtype, device, gen, report))
    return report
