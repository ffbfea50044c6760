"""Gram matrices with certified rounding, and the certified Gram ("ghost") norm.

The per-example gradient of a layer over a sequence is ``G = Σ_t a_t b_tᵀ``; its squared norm is
``N = Σ_{t,s} (a_t·a_s)(b_t·b_s)`` and the inner product of two such gradients of one parameter
is ``Σ_{t,s} (a_t·a'_s)(b_t·b'_s)``. :func:`gram` computes the Gram matrices: fp32 products over
blocks of :data:`~._float.BLOCK` features, each block's result added in fp64 — so the fp32
rounding of an entry is ``γ32(BLOCK)`` of ``‖x_t‖‖y_s‖`` whatever the feature dimension, at about
the cost of one fp32 product. The Gram matrices' product and its sum over ``(t, s)`` run in fp64.

**Entry bound.** For fp32 inputs of dimension ``d`` with ``‖x_t‖ ≤ ξ_t``, ``‖y_s‖ ≤ ψ_s``:
``|Ĝ_ts − x_t·y_s| ≤ c·ξ_tψ_s + k·(ξ_t + ψ_s) + m`` with ``c = γ32(BLOCK) + 2·γ64(d)``,
``k = 2·ETA·√d·(1 + c)`` (subnormal inputs read as zero) and ``m = 5·d·ETA·(1 + c)`` (products
and sums flushed to zero). With ``λ = max(k/√c, √m)`` this is at most ``ε_t ε_s`` for
``ε_t = √c·ξ_t + λ`` — a rank-one bound, so every sum over ``(t, s)`` below factorises.

**Norm bound** (:class:`GramTerms`, :func:`error_bound`). With ``α_t ≥ ‖a_t‖``, ``β_t ≥ ‖b_t‖``,
their entry-bound vectors ``x_t`` (a side; 0 when the a side is exact, e.g. an embedding's
one-hot rows) and ``y_t`` (b side), and ``P_ts = fl64(Ĝa_ts·Ĝb_ts)``:
``|P_ts − Ga_ts Gb_ts| ≤ x_tx_s·β_tβ_s + α_tα_s·y_ty_s + x_tx_s·y_ty_s``
``+ u64·(α_t+x_t)(α_s+x_s)(β_t+y_t)(β_s+y_s)`` (using ``|Ga_ts| ≤ α_tα_s``), and the fp64 sum
over ``T_u·T_v`` pairs adds ``γ64(T_uT_v)·Σ|P|``.
Summed, with ``X = Σ_t x_tβ_t``, ``Y = Σ_t α_ty_t``, ``Z = Σ_t x_ty_t``,
``W = Σ_t (α_t + x_t)(β_t + y_t)`` per piece:

``|N̂_uv − N_uv| ≤ X_uX_v + Y_uY_v + Z_uZ_v + (u64 + γ64(T_uT_v)(1 + u64))·W_uW_v``
``+ 2·T_uT_v·2⁻¹⁰²²``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.dpsgd.certify._float import BLOCK, ETA, SAFE, U64, gamma32, gamma64

if TYPE_CHECKING:
    import torch

__all__ = [
    "WIDE_MACS",
    "GramCache",
    "GramTerms",
    "diagonal_factors",
    "diagonal_from",
    "diagonal_norms",
    "entry_error",
    "error_bound",
    "gram",
    "wide",
]

ETA64 = 2.0**-1022  # fp64's smallest normal number (fp64 inputs' underflow)


def _wide(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x if x.dtype in (torch.float32, torch.float64) else x.float()


#: a Gram matrix of at most this many multiply-adds is formed in fp64 (products of fp32 numbers
#: exact, so its rounding is fp64's): about twice an fp32 product's time on CPU, and no fp32
#: slack on small layers (fp32's would clip up to ~1e-5 harder, more where tokens cancel)
WIDE_MACS = 1 << 23


def wide(x: torch.Tensor, y: torch.Tensor | None = None) -> bool:
    """Whether :func:`gram` forms ``x·yᵀ`` in fp64 (fp64 inputs, or a small product).

    >>> import torch
    >>> wide(torch.ones(2, 3, 4)), wide(torch.ones(8, 512, 4096))
    (True, False)
    """
    import torch

    y = x if y is None else y
    if torch.float64 in (x.dtype, y.dtype):
        return True
    macs = int(x.shape[0]) * int(x.shape[1]) * int(y.shape[1]) * int(x.shape[-1])
    return macs <= WIDE_MACS


def gram(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, S]`` fp64 matrix of ``x_t·y_s`` for ``x [B, T, d]``, ``y [B, S, d]`` (``y=None``:
    ``x``): fp32 products over blocks of :data:`BLOCK` features summed in fp64, or one fp64
    product where :func:`wide` says so.

    >>> import torch
    >>> gram(torch.ones(1, 2, 600))[0].tolist()
    [[600.0, 600.0], [600.0, 600.0]]
    """
    import torch

    if wide(x, y):
        xd = x.double()
        yd = xd if y is None or y is x else y.double()  # one conversion for x·xᵀ
        return torch.bmm(xd, yd.transpose(1, 2))
    y = x if y is None else y
    x, y = _wide(x), _wide(y)
    d = int(x.shape[-1])
    if d <= BLOCK:
        return torch.bmm(x, y.transpose(1, 2)).double()
    out = torch.zeros(x.shape[0], x.shape[1], y.shape[1], dtype=torch.float64, device=x.device)
    buf = torch.empty(x.shape[0], x.shape[1], y.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, d, BLOCK):
        xb, yb = x[..., start : start + BLOCK], y[..., start : start + BLOCK]
        torch.bmm(xb, yb.transpose(1, 2), out=buf)
        out += buf
    return out


def entry_error(d: int, dtype: torch.dtype, wide: bool = False) -> tuple[float, float]:
    """``(√c, λ)`` of the rank-one entry bound ``ε_t = √c·ξ_t + λ`` of :func:`gram` over ``d``
    features for inputs of ``dtype`` (see the module docstring); ``wide``: the product was
    formed in fp64 (:func:`wide`).

    >>> root, lam = entry_error(576, __import__("torch").float32)
    >>> round(root**2 / 2**-24)  # γ32(256) in units of u32
    256
    """
    import torch

    if d == 0:
        return 0.0, 0.0
    if dtype == torch.float64:
        c, eta = gamma64(d), ETA64
    elif wide:  # fp32 products exact in fp64; a subnormal input may still be read as zero
        c, eta = gamma64(d), ETA
    else:
        c, eta = gamma32(min(d, BLOCK)) + 2.0 * gamma64(d), ETA
    k = 2.0 * eta * math.sqrt(d) * (1.0 + c)
    m = 5.0 * d * eta * (1.0 + c)
    root = math.sqrt(c)
    return root, max(k / root, math.sqrt(m))


def diagonal_factors(d: int, dtype: torch.dtype, wide: bool) -> tuple[float, float, float, float]:
    """``(p, m, q, r)`` with ``‖x_t‖² ≤ ((ĝ + p)·m + q)/r`` for the diagonal ``ĝ`` of
    ``gram(x)`` over ``d`` features of ``dtype`` (``wide``: formed in fp64); see
    :func:`diagonal_norms`. The unused terms are an exact ``+ 0`` and ``/ 1``.

    >>> diagonal_factors(0, __import__("torch").float32, True)
    (0.0, 0.0, 0.0, 1.0)
    """
    import torch

    if d == 0:
        return 0.0, 0.0, 0.0, 1.0
    if dtype == torch.float64:
        return 2.0 * d * ETA64, 1.0 + 2.0 * gamma64(d + 1), 0.0, 1.0
    if wide:
        return 0.0, 1.0 + 2.0 * gamma64(d), d * ETA * ETA, 1.0
    return 0.0, 1.0 + 2.0 * gamma64(d), 3.0 * d * ETA, 1.0 - gamma32(min(d, BLOCK))


def diagonal_from(g: torch.Tensor, factors: tuple[Any, Any, Any, Any]) -> torch.Tensor:
    """:func:`diagonal_norms` from :func:`diagonal_factors` (floats, or fp64 0-d tensors: the
    form a compiled caller passes, one graph for every ``d``)."""
    p, m, q, r = factors
    diag = g.flatten(1)[:, :: int(g.shape[1]) + 1].clamp(min=0.0)  # the diagonals, [B, T]
    out: torch.Tensor = (((diag + p) * m + q) / r).sqrt() * (1.0 + SAFE)
    return out


def diagonal_norms(g: torch.Tensor, d: int, dtype: torch.dtype, wide: bool) -> torch.Tensor:
    """Certified bounds of ``‖x_t‖`` ``[B, T]`` (fp64) from the diagonal of ``g = gram(x)``.

    The diagonal is a sum of ``d`` squares (non-negative terms, so no cancellation): blocked
    fp32, each block's sum ``ŝ ≥ (1 − γ32(BLOCK))·s − 2·BLOCK·ETA`` and the fp64 sum over the
    blocks within ``γ64(blocks)``, a subnormal input read as zero losing less than ``ETA²``:
    ``‖x‖² ≤ (ĝ·(1 + 2γ64(d)) + 3·d·ETA)/(1 − γ32(BLOCK))``; fp64 products of fp32 inputs:
    ``ĝ·(1 + 2γ64(d)) + d·ETA²``; fp64 inputs: ``(ĝ + 2·d·2⁻¹⁰²²)·(1 + 2γ64(d + 1))``
    (:func:`diagonal_factors`). A non-finite diagonal (a block that overflowed) stays
    non-finite: recompute those tokens.

    >>> import torch
    >>> x = torch.tensor([[[3.0, 4.0]]])
    >>> 5.0 <= float(diagonal_norms(gram(x), 2, x.dtype, True)[0, 0]) < 5.0 + 1e-9
    True
    """
    return diagonal_from(g, diagonal_factors(d, dtype, wide))


@dataclass(frozen=True)
class GramTerms:
    """The per-example sums of one piece that its Gram-route error bounds need (fp64 ``[B]``).

    With ``x_t = √c_a·α_t + λ_a`` and ``y_t = √c_b·β_t + λ_b`` (the two sides' entry bounds,
    ``x = 0`` when the a side's Gram is exact) every sum of the module docstring is a linear
    combination of ``S = Σ_t α_tβ_t``, ``Pa = Σ_t α_t``, ``Pb = Σ_t β_t`` and ``T``:
    ``X = √c_a·S + λ_a·Pb``, ``Y = √c_b·S + λ_b·Pa``,
    ``Z = √(c_a c_b)·S + √c_a λ_b·Pa + λ_a√c_b·Pb + λ_aλ_b·T`` and
    ``W = (1+√c_a)(1+√c_b)·S + (1+√c_a)λ_b·Pa + λ_a(1+√c_b)·Pb + λ_aλ_b·T`` — so they cost a
    few operations on ``[B]`` vectors, whatever the sequence length.
    """

    X: torch.Tensor
    Y: torch.Tensor
    Z: torch.Tensor
    W: torch.Tensor
    steps: int

    @classmethod
    def of(
        cls,
        sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        steps: int,
        a_err: tuple[float, float],
        b_err: tuple[float, float],
    ) -> GramTerms:
        """From ``(S, Pa, Pb)`` (upper bounds, fp64 ``[B]``), ``T`` and the two sides'
        ``(√c, λ)`` (:func:`entry_error`)."""
        s, pa, pb = sums
        ra, la = a_err
        rb, lb = b_err
        return cls(
            X=s * ra + pb * la,
            Y=s * rb + pa * lb,
            Z=s * (ra * rb) + pa * (ra * lb) + pb * (la * rb) + la * lb * steps,
            W=s * ((1 + ra) * (1 + rb))
            + pa * ((1 + ra) * lb)
            + pb * (la * (1 + rb))
            + la * lb * steps,
            steps=steps,
        )


def error_bound(u: GramTerms, v: GramTerms) -> torch.Tensor:
    """``[B]`` fp64 bound of ``|N̂_uv − N_uv|`` for the Gram-route inner product of ``u`` and
    ``v`` (``u is v``: the squared norm); see the module docstring."""
    pairs = u.steps * v.steps
    g = U64 + gamma64(max(pairs, 1)) * (1.0 + U64)
    bound = u.X * v.X + u.Y * v.Y + u.Z * v.Z + g * (u.W * v.W) + 2.0 * pairs * ETA64
    return bound * (1.0 + SAFE)


class GramCache:
    """The last input Gram matrix (fp64, from :func:`gram`), reused by the next piece whose
    ``b`` is a view of the very same memory (the q/k/v projections, or gate/up, read one
    input): one entry, so it never holds more than one Gram matrix. The input is kept alive
    while cached and its version counter is part of the key (an in-place change is a miss).

    >>> import torch
    >>> x, cache = torch.ones(1, 2, 3), GramCache()
    >>> cache.gram(x.reshape(1, 2, 3)) is cache.gram(x.reshape(1, 2, 3))
    True
    """

    __slots__ = ("_input", "_key", "_value")

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._input: torch.Tensor | None = None
        self._value: torch.Tensor | None = None

    def gram(self, b: torch.Tensor) -> torch.Tensor:
        """``gram(b)``, from the cache when ``b`` is the last input."""
        key = (b.data_ptr(), tuple(b.shape), b.stride(), b.dtype, b.device, b._version)
        if self._key != key or self._value is None:
            self._value = gram(b)
            self._key, self._input = key, b
        return self._value
