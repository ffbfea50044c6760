"""The engine protocol (a chunk in → losses, squared norms, aux; then the weighted sum), the
per-call record of diagnostics and the running sums.

An engine turns one chunk of ``m`` examples into a :class:`ChunkOut`; the clip state turns its
squared norms into factors (:mod:`._base`); the engine then adds the factor-weighted sum of
the chunk's per-example gradients to the running fp32 sums. Two engines implement it: the vmap
engine (:mod:`._vmap_engine`) and the book-keeping engine (:mod:`._bookkeeping`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opake.dpsgd.clipping._grads import ClipAux

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._units import RowUnits
    from opake.dpsgd.clipping._base import ChunkNorms, ClipFactors

__all__ = [
    "CallRecord",
    "ChunkEngine",
    "ChunkOut",
    "LazySums",
    "outer_transform_differentiates",
]


@dataclass(frozen=True)
class ChunkOut:
    """What an engine computed for one chunk of ``m`` examples.

    ``loss`` ``[m]``; ``leaf_sq``/``bound_sq`` ``[m, leaves]`` fp64 (reported squared norms and
    the ones to clip with, see :class:`~._base.ChunkNorms`); ``aux`` what ``loss_fn`` returned
    next to the loss (``None`` without ``has_aux``); ``payload`` whatever the engine needs for
    :meth:`ChunkEngine.accumulate` (per-example gradients, book-keeping pieces); ``slack``
    ``[m, leaves]`` fp64 or ``None``: the part of each added tensor's rounding that does not
    scale with the clip factor — :meth:`ChunkEngine.accumulate` must add at most
    ``w·√bound_sq + slack`` for factor ``w``; the loop takes ``slack`` off the factors first
    (:func:`opake.dpsgd.certify.adjust_factors`).
    """

    loss: torch.Tensor
    leaf_sq: torch.Tensor
    bound_sq: torch.Tensor
    aux: Any
    payload: Any
    slack: torch.Tensor | None = None


class ChunkEngine(Protocol):
    """One way of computing per-example norms and the clipped sum (see the module docstring)."""

    #: ``"vmap"`` or ``"bookkeeping"`` (reported as ``grad_fn.engine``)
    name: str

    def chunk(self, args: tuple[Any, ...], m: int, units: RowUnits | None = None) -> ChunkOut:
        """Losses, per-leaf squared norms and aux of the ``m`` examples in ``args``.

        With ``units`` (privacy units, :class:`~opake.dpsgd.bookkeeping._units.RowUnits`),
        ``loss`` and ``aux`` stay per row while the norms, bounds, slack and payload are per
        unit: ``accumulate`` then adds each unit's summed gradient, whose norm was bounded.
        """
        ...

    def accumulate(
        self, out: ChunkOut, factors: ClipFactors, sums: dict[str, torch.Tensor]
    ) -> None:
        """``sums[name] += Σ_i factors.leaf_factor[i, j] · g_ij`` for every leaf ``j``."""
        ...


class CallRecord:
    """Collects the per-chunk diagnostics of one call into a :class:`ClipAux`."""

    def __init__(self, device: torch.device, real_total: torch.Tensor, differentiable: bool):
        import torch

        self.device = device
        self.real_total = real_total
        self.differentiable = differentiable
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.clipped: list[torch.Tensor] = []
        self.groups: list[torch.Tensor] = []
        self.aux: list[Any] = []
        self.scaled = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, out: ChunkOut, norms: ChunkNorms, factors: ClipFactors, has_aux: bool) -> None:
        """Record one chunk."""
        import torch

        f32 = torch.float32
        total, finite, is_real = norms.total, norms.finite, norms.is_real
        self.nonfinite = self.nonfinite + (is_real & ~finite).sum()
        self.scaled = self.scaled + (is_real & factors.shrunk).sum()
        if factors.count is not None:
            self.count = self.count + factors.count
        loss = out.loss if self.differentiable else out.loss.detach()
        self.losses.append(loss.to(f32))
        self.norms.append(total.to(f32))
        self.clipped.append(factors.clipped_norms.to(f32))
        if factors.group_norms is not None:
            self.groups.append(factors.group_norms.to(f32))
        if has_aux:
            self.aux.append(out.aux)

    def _cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(list(parts))

    def result(self, group_names: tuple[str, ...] | None) -> ClipAux:
        """The :class:`ClipAux` of the call."""
        import torch
        from torch.utils._pytree import tree_map

        loss_aux: Any = None
        if self.aux:
            parts = self.aux
            loss_aux = parts[0] if len(parts) == 1 else tree_map(lambda *x: torch.cat(x), *parts)
        real = self.real_total
        rate = torch.where(real > 0, self.scaled.to(torch.float32) / real.clamp(min=1), 0.0)
        group_norms = None
        if group_names is not None:
            norms = self._cat(self.groups) if self.groups else None
            group_norms = {
                g: norms[:, k] if norms is not None else torch.zeros(0, device=self.device)
                for k, g in enumerate(group_names)
            }
        return ClipAux(
            loss_values=self._cat(self.losses),
            grad_norms=self._cat(self.norms),
            clipped_grad_norms=self._cat(self.clipped),
            clipping_rate=rate.to(torch.float32),
            batch_size=real,
            nonfinite_count=self.nonfinite,
            loss_aux=loss_aux,
            group_grad_norms=group_norms,
        )


class LazySums(dict[str, "torch.Tensor"]):
    """Running fp32 sums by leaf name, each allocated (zeros) on its first lookup.

    The book-keeping engine frees each layer's recorded tensors as it adds that layer's sum,
    so a sum allocated on its first add replaces the recording instead of sitting beside it
    through the forward and the backward (one parameter-sized fp32 tensor per leaf).

    >>> import torch
    >>> sums = LazySums({"w": (2,)}, torch.device("cpu"))
    >>> len(sums), sums["w"].tolist(), len(sums)
    (0, [0.0, 0.0], 1)
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        super().__init__()
        self._shapes = shapes
        self._device = device

    def __missing__(self, name: str) -> torch.Tensor:
        import torch

        value = torch.zeros(self._shapes[name], dtype=torch.float32, device=self._device)
        self[name] = value
        return value


def outer_transform_differentiates() -> bool:
    """True when a ``torch.func`` grad/vjp/jvp transform is active around this call."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:  # pragma: no cover - private API moved: assume the safe default
        return False
    keys = {TransformType.Grad, TransformType.Jvp}
    return any(interp.key() in keys for interp in retrieve_all_functorch_interpreters())
