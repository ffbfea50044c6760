"""The canaries' audit layer and their examples, crafted against the clipping engines' numerics.

Every gradient canary is one example of an ``nn.Linear`` audit layer (its weight is the audit
parameter, ``R × K``, that the model never reads) over a sequence of :data:`TOKENS` tokens: its
loss is ``Σ_t ⟨W x_t, y_t⟩``, so its gradient is ``Σ_t y_t x_tᵀ`` — what the book-keeping engine
sees as recorded inputs ``x_t`` and output gradients ``y_t`` — and the auditor knows its unit
direction ``p qᵀ``. The kinds:

- ``dirac`` / ``random`` (plain): one token, ``x = q``, ``y = g·p`` — one coordinate of the audit
  matrix, or a random rank-one direction;
- ``cancellation``: every token carries one huge input component ``M e_0`` (``M = 2³⁰``) and the
  output gradients alternate in sign, so the huge per-token terms cancel exactly; the even
  tokens add ``δ·q``. The true gradient is ``g·δ·(T/2)·p qᵀ``, but every input Gram entry is
  ``M² + δ_t δ_s`` with ``δ² < ulp(M²)/2`` in fp32 and fp64: the Gram ("ghost") norm is
  exactly 0;
- ``underflow``: inputs ``±2⁻⁷⁶`` (their fp32 squares underflow to 0) and output gradients of
  ``≈ 10²¹`` (finite in fp32, their Gram formed in fp64), alternating together: the fp32 input
  Gram matrix is exactly 0 while the gradient is large;
- ``absorption``: two tokens agree on the first ¾ of every block of
  :data:`~opake.dpsgd.certify.BLOCK` input features (ones) and differ on the last ¼ (``+2⁻¹²``
  against ``−2⁻¹³``), with opposite output gradients: inside a block's fp32 reduction every
  product of the small entries is absorbed by the ones (round-half-to-even included), so the
  computed Gram norm is 0.

Every kind's true norm is ``gradient_norm × C``. A correct engine clips them all to C (the
book-keeping engine proves its bounds for every input and measures such examples exactly); an
engine whose norms trust the computed Gram norm lets the crafted ones through whole.

The shapes are chosen from the engine's public constants so that the crafted numerics are the
ones it computes: the layer takes the Gram route
(:func:`~opake.dpsgd.bookkeeping.ghost_is_cheaper`), each microbatch of canaries has enough rows
that the input Gram matrix is formed in fp32 blocks (more than
:data:`~opake.dpsgd.certify.WIDE_MACS` multiply-adds: masked padding rows fill it up) and few
enough that the output-gradient Gram matrix is formed in fp64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opake.auditing._canaries import CRAFTED_KINDS
from opake.auditing._canaries import KINDS as PLAIN_KINDS

__all__ = [
    "ROWS",
    "SCALES",
    "TOKENS",
    "AuditLayer",
    "Geometry",
    "batch_rows",
    "canary_losses",
    "geometry",
]

#: tokens per canary example
TOKENS = 16
#: rows of the audit matrix (the audit layer's output features)
ROWS = 32
_MIN_COLUMNS = 512
_HUGE = 2.0**30  # the cancellation canaries' shared input component
_TINY = 2.0**-76  # an input whose fp32 square (2⁻¹⁵²) underflows to 0
_ONES = 0.75  # share of each block of input features set to one by absorption canaries
#: the range of ``gradient_norm × C`` the crafted canaries are built for (their output gradients
#: stay finite in fp32 and their gradient's entries normal)
SCALES = (2.0**-40, 2.0**50)


class AuditLayer(torch.nn.Module):
    """The audit layer: ``opake_audit.canaries``, an ``nn.Linear(K, R, bias=False)`` whose weight
    (``opake_audit.canaries.weight``, the audit parameter) only canary examples read."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.opake_audit = torch.nn.Module()
        self.opake_audit.canaries = torch.nn.Linear(columns, rows, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.opake_audit.canaries
        assert isinstance(layer, torch.nn.Linear)
        out: torch.Tensor = layer(x)
        return out


def canary_losses(
    fmodel: Callable[..., Any],
) -> Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]:
    """The batched canary loss ``Σ_t ⟨W x_t, y_t⟩`` per example (``[B]``) over ``fmodel``."""

    def losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (fmodel(params, x) * y).sum(dim=(1, 2))
        return out

    return losses


class Geometry:
    """The canaries' shapes and unit directions (made by :func:`geometry`).

    ``labels[i]`` is canary i's kind; ``p [m, R]`` and ``q [m, K]`` (fp32) are the vectors its
    example is built from, and ``unit_p``/``unit_q`` (fp64, unit) its direction ``p qᵀ``.
    """

    def __init__(self, labels: tuple[str, ...], p: torch.Tensor, q: torch.Tensor) -> None:
        self.labels = labels
        self.p, self.q = p, q
        self.rows, self.columns = int(p.shape[1]), int(q.shape[1])
        pd, qd = p.double(), q.double()
        self.unit_p = pd / pd.norm(dim=1, keepdim=True)
        self.unit_q = qd / qd.norm(dim=1, keepdim=True)

    def examples(self, indices: Sequence[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples ``(x [n, T, K], y [n, T, R])`` fp32 of canaries ``indices``, each with
        a gradient of norm ``scale`` (``gradient_norm × C``)."""
        n, steps = len(indices), TOKENS
        x = torch.zeros(n, steps, self.columns)
        y = torch.zeros(n, steps, self.rows)
        if not n:
            return x, y
        index = torch.as_tensor(list(indices), dtype=torch.long)
        labels = [self.labels[i] for i in indices]
        for kind in dict.fromkeys(labels):
            rows = torch.as_tensor([j for j, k in enumerate(labels) if k == kind])
            p, q = self.p[index[rows]].double(), self.q[index[rows]].double()
            xs, ys = _build(kind, p, q, scale)
            x[rows], y[rows] = xs, ys
        return x, y


def _signs(steps: int) -> torch.Tensor:
    return torch.tensor([(-1.0) ** t for t in range(steps)], dtype=torch.float64)


def _build(
    kind: str, p: torch.Tensor, q: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kind's examples (fp32) from its vectors (fp64), true gradient norm ``scale``."""
    n, rows, columns, steps = p.shape[0], p.shape[1], q.shape[1], TOKENS
    x = torch.zeros(n, steps, columns, dtype=torch.float64)
    y = torch.zeros(n, steps, rows, dtype=torch.float64)
    norm_p, norm_q = p.norm(dim=1, keepdim=True), q.norm(dim=1, keepdim=True)
    alt = _signs(steps)[None, :, None]
    if kind in PLAIN_KINDS:
        x[:, 0] = q
        y[:, 0] = p * (scale / (norm_p * norm_q))
    elif kind == "cancellation":  # q_0 = 0: the huge component and δ·q never share an entry
        x[:, :, 0] = _HUGE
        x[:, 0::2] += q[:, None, :] / norm_q[:, None, :]  # δ = 1 on the even tokens
        y[:] = alt * (p * (scale / (norm_p * steps / 2)))[:, None, :]
    elif kind == "underflow":  # p, q are ±1 sign vectors
        x[:] = alt * (_TINY * q)[:, None, :]
        big = scale / (steps * _TINY * math.sqrt(rows * columns))
        y[:] = alt * (big * p)[:, None, :]
    else:  # absorption: q is ±1 on the small entries and 0 on the ones
        small = q != 0
        x[:, 0] = torch.where(small, q * 2.0**-12, 1.0)
        x[:, 1] = torch.where(small, -q * 2.0**-13, 1.0)
        diff = (x[:, 0] - x[:, 1]).norm(dim=1, keepdim=True)
        y[:, 0] = p * (scale / (norm_p * diff))
        y[:, 1] = -y[:, 0]
    return x.float(), y.float()


def _columns(onehot: int) -> int:
    """Input features K: a multiple of the engine's fp32 block, room for every Dirac canary."""
    from opake.dpsgd.certify import BLOCK

    need = max(_MIN_COLUMNS, math.ceil(onehot / ROWS) + 1)
    return BLOCK * math.ceil(need / BLOCK)


def geometry(count: int, kind: str, crafted: bool, seed: int) -> Geometry:
    """The labels and vectors of ``count`` canaries: ``kind`` and, with ``crafted``, each crafted
    kind in turn (canary i has kind ``kinds[i % len(kinds)]``)."""
    from opake.dpsgd.certify import BLOCK

    kinds = (kind, *CRAFTED_KINDS) if crafted else (kind,)
    labels = tuple(kinds[i % len(kinds)] for i in range(count))
    columns = _columns(sum(1 for label in labels if label == "dirac"))
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(count, ROWS, generator=gen)
    q = torch.randn(count, columns, generator=gen)
    signs_p = torch.randint(0, 2, (count, ROWS), generator=gen).float() * 2.0 - 1.0
    signs_q = torch.randint(0, 2, (count, columns), generator=gen).float() * 2.0 - 1.0
    ones = (torch.arange(columns) % BLOCK) < round(_ONES * BLOCK)
    dirac = 0
    for i, label in enumerate(labels):
        if label == "dirac":  # coordinate (r, k) of the audit matrix; column 0 left out
            p[i], q[i] = 0.0, 0.0
            p[i, dirac % ROWS] = 1.0
            q[i, 1 + dirac // ROWS] = 1.0
            dirac += 1
        elif label == "cancellation":
            q[i, 0] = 0.0
        elif label == "underflow":
            p[i], q[i] = signs_p[i], signs_q[i]
        elif label == "absorption":
            p[i], q[i] = signs_p[i], torch.where(ones, 0.0, signs_q[i])
    return Geometry(labels, p, q)


def batch_rows(count: int, columns: int) -> tuple[int, int]:
    """``(rows, microbatch)`` for a call with ``count`` canaries: at least enough rows (padding
    included) that each microbatch's input Gram matrix takes more than ``WIDE_MACS``
    multiply-adds (formed in fp32 blocks), microbatches small enough that the output-gradient
    Gram matrix takes at most that many (formed in fp64)."""
    from opake.dpsgd.certify import WIDE_MACS

    least = WIDE_MACS // (TOKENS * TOKENS * columns) + 1
    chunk = max(least, WIDE_MACS // (TOKENS * TOKENS * ROWS))
    total = max(count, least)
    tail = total % chunk
    if 0 < tail < least:
        total += least - tail
    return total, chunk
