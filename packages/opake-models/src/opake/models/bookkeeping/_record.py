"""The fused experts' forward while the book-keeping engine records: sparse, tapped, exact.

Token slots (token, top-k position) are sorted by expert; each expert runs on its own slots
with the *detached* fused weights (so the backward computes activation gradients only), and
the combined output ``[B, T, H]`` goes through the engine's tap
(:func:`opake.dpsgd.bookkeeping.implicit_use`). From its gradient ``g`` the build step forms,
per slot ``s`` of token ``t`` routed to expert ``e`` with weight ``w``:

- down projection: input ``z_s`` (the gated activation), output gradient ``δy_s = w·g_t``;
- gate/up projection: input ``x_t``, output gradient ``δh_s`` — the activation's vector-Jacobian
  product at the saved pre-activation ``h_s`` of ``δz_s = δy_s W_down[e]ᵀ``;
- biases (GPT-OSS): ``Σ δh_s`` and ``Σ δy_s`` per example and expert.

Each weight's per-example gradients are an :class:`~opake.models.bookkeeping.ExpertGrads`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opake.functional import cached_signature
from opake.models._experts import fused_experts
from opake.models.bookkeeping._grads import ExpertGrads, SlotLayout, grouped_mm_takes

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping import ImplicitUse

__all__ = ["experts_forward", "recorded_experts", "supports_recording"]


def supports_recording(module: torch.nn.Module) -> bool:
    """Whether :func:`recorded_experts` computes ``module`` (a transformers fused experts
    module without a post-expert norm, weights ``[E, ...]``)."""
    import torch

    gated = bool(getattr(module, "has_gate", True))
    first = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(first, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and first.dim() == 3
        and down.dim() == 3
        and hasattr(module, "num_experts")
        and not getattr(module, "has_post_expert_norm", False)
        and (gated or callable(getattr(module, "act_fn", None)))
    )


@dataclass(frozen=True)
class _Slots:
    """The routed slots of one call, sorted by expert (then by token)."""

    token: torch.Tensor  # [N] flat token index b·T + t
    example: torch.Tensor  # [N]
    weight: torch.Tensor  # [N] routing weight (differentiable)
    expert: torch.Tensor  # [N]
    counts: tuple[int, ...]  # slots per expert


def _slots(index: torch.Tensor, weights: torch.Tensor, experts: int) -> _Slots:
    import torch

    _, steps, k = index.shape
    flat = index.reshape(-1)
    key = torch.where((flat >= 0) & (flat < experts), flat, experts)  # dropped slots last
    order = torch.argsort(key, stable=True)
    counts = tuple(int(c) for c in torch.bincount(key, minlength=experts + 1).tolist())
    order = order[: sum(counts[:experts])]
    token = torch.div(order, k, rounding_mode="floor")
    example = torch.div(token, steps, rounding_mode="floor")
    return _Slots(token, example, weights.reshape(-1)[order], key[order], counts[:experts])


def _grouped_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one CPU ``grouped_mm`` can run the row-major slots ``x [N, in]`` through
    ``weight [E, in, out]`` (and its backward); not for no slots at all."""
    if x.dim() != 2 or not x.shape[0] or x.stride(-1) != 1:
        return False
    return grouped_mm_takes(x, weight, cols=int(weight.shape[-1]))


class _GroupedMatmulFunction(Protocol):
    """The ``autograd.Function`` class below, as called here (torch leaves ``apply`` untyped)."""

    def apply(self, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor: ...


class _GroupedMatmul:
    """``grouped_mm(x, w, offs=ends)`` differentiable in ``x`` only (the weights are detached
    while recording), its backward the grouped matmul of the contiguous output gradient with
    ``wᵀ`` (torch's own backward refuses an expanded gradient's zero strides)."""

    fn: _GroupedMatmulFunction | None = None

    @classmethod
    def apply(cls, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        if cls.fn is None:
            import torch

            @cached_signature
            class GroupedMatmul(torch.autograd.Function):
                @staticmethod
                def forward(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
                    return torch.nn.functional.grouped_mm(x, w, offs=ends)

                @staticmethod
                def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                    ctx.w, ctx.ends = inputs[1], inputs[2]

                @staticmethod
                def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
                    grad = grad.contiguous()
                    if grad.data_ptr() % 16:  # a view at an odd offset
                        grad = grad.clone()
                    back = ctx.w.transpose(-2, -1)
                    out = torch.nn.functional.grouped_mm(grad, back, offs=ctx.ends)
                    return out, None, None

            cls.fn = GroupedMatmul
        return cls.fn.apply(x, w, ends)


def _per_expert(
    x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...], transposed: bool
) -> torch.Tensor:
    """Each expert's slots ``x`` (consecutive, ``counts``) through its weight (``[E, in, out]``
    when ``transposed``, else ``[E, out, in]``): one grouped matmul where the CPU kernel takes
    the operands, else one matmul per expert over ``torch.split`` views (whose backward
    concatenates, instead of a zero-filled full-size gradient per slice)."""
    import torch

    w = weight if transposed else weight.transpose(-2, -1)  # [E, in, out]
    if _grouped_ok(x, w):
        ends = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _GroupedMatmul.apply(x, w.detach(), ends)
    outs = [part @ w[e] for e, part in enumerate(torch.split(x, list(counts))) if counts[e]]
    if not outs:
        return x.new_zeros(0, w.shape[-1])
    return torch.cat(outs)


def _weight(module: torch.nn.Module, params: dict[str, torch.Tensor], attr: str) -> torch.Tensor:
    """The differentiated tensor ``attr`` (detached), else the module's own (frozen) one."""
    tensor = params[attr] if attr in params else getattr(module, attr)
    return tensor.detach()


def _gate(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    fused = fused_experts(module)
    if bool(getattr(module, "has_gate", True)):
        return fused._apply_gate
    return fused.act_fn


def _bias_grads(grads: torch.Tensor, slots: _Slots, batch: int, experts: int) -> torch.Tensor:
    """``[B, E, d]`` per-example bias gradients ``Σ`` of the slots' gradients."""
    out = grads.new_zeros(batch * experts, grads.shape[-1])
    out.index_add_(0, slots.example * experts + slots.expert, grads)
    return out.reshape(batch, experts, -1)


def recorded_experts(
    module: torch.nn.Module,
    use: ImplicitUse,
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``module``'s output ``[B, T, H]`` for ``x [B, T, H]`` and top-k ``index``/``weights``
    ``[B, T, k]``, recorded through ``use`` (an :class:`~opake.dpsgd.bookkeeping.ImplicitUse`
    of ``module``). Indices outside ``[0, E)`` select nothing.
    """
    out, saved = experts_forward(module, use.params, x, index, weights)
    return use.tap(out, saved.build)


def experts_forward(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, _Saved]:
    """The sparse forward with the (detached) differentiated ``params``; returns the output
    ``[B, T, H]`` and what :meth:`_Saved.build` needs after the backward."""
    experts = int(fused_experts(module).num_experts)
    transposed = bool(getattr(module, "is_transposed", False))
    first = "gate_up_proj" if bool(getattr(module, "has_gate", True)) else "up_proj"
    p = {attr: t.detach() for attr, t in params.items()}
    batch, steps, size = x.shape
    slots = _slots(index, weights, experts)
    flat = x.reshape(-1, size)
    up = _weight(module, p, first)
    h = _per_expert(flat[slots.token], up, slots.counts, transposed)
    if f"{first}_bias" in p:
        h = h + p[f"{first}_bias"][slots.expert]
    caught: dict[str, torch.Tensor] = {}
    if h.requires_grad:  # the backward computes δh anyway: keep it (else build recomputes it)
        # torch leaves Tensor.register_hook unannotated: its signature, stated
        register_hook: Callable[[Callable[[torch.Tensor], None]], object] = h.register_hook
        register_hook(lambda grad: caught.__setitem__("dh", grad.detach()))
    z = _gate(module)(h)
    down = _weight(module, p, "down_proj")
    y = _per_expert(z, down, slots.counts, transposed)
    if "down_proj_bias" in p:
        y = y + p["down_proj_bias"][slots.expert]
    scaled = y * slots.weight[:, None].to(y.dtype)
    out = flat.new_zeros(flat.shape).index_add_(0, slots.token, scaled.to(flat.dtype))
    saved = _Saved(
        module,
        first,
        transposed,
        tuple(params),
        slots,
        batch,
        experts,
        flat.detach(),
        h.detach(),
        z.detach(),
        down,
        caught,
    )
    return out.reshape(batch, steps, size), saved


@dataclass(frozen=True)
class _Saved:
    """One recorded call: what the per-example gradients are built from."""

    module: torch.nn.Module
    first: str  # "gate_up_proj" or "up_proj"
    transposed: bool
    attrs: tuple[str, ...]  # the differentiated attributes
    slots: _Slots
    batch: int
    experts: int
    x: torch.Tensor  # [B·T, H]
    h: torch.Tensor  # [N, 2I] pre-activation
    z: torch.Tensor  # [N, I] activation
    down: torch.Tensor  # [E, ...] down projection
    caught: dict[str, torch.Tensor]  # "dh": δh as the backward computed it, if it did

    def build(self, grad: torch.Tensor) -> dict[str, ExpertGrads | torch.Tensor]:
        """Per-example gradients of every differentiated attribute from the output's
        gradient ``[B, T, H]``."""
        import torch

        slots, first, transposed = self.slots, self.first, self.transposed
        g = grad.reshape(-1, grad.shape[-1]).float()[slots.token]
        dy = g * slots.weight.detach().float()[:, None]  # [N, H]
        dh = self.caught.get("dh")
        if dh is None:  # δh = the gate's vector-Jacobian product of δz = δy W_downᵀ
            dz = _per_expert(dy, self.down.float(), slots.counts, not transposed)
            with torch.enable_grad():
                h = self.h.detach().requires_grad_(True)
                (dh,) = torch.autograd.grad(_gate(self.module)(h), h, dz.to(h.dtype))
        dh = dh.float()
        xs = self.x[slots.token].float()
        z = self.z.float()
        out: dict[str, ExpertGrads | torch.Tensor] = {}
        layout = SlotLayout()  # the same slots: shared padding
        if first in self.attrs:
            a, b = (xs, dh) if transposed else (dh, xs)
            out[first] = ExpertGrads(a, b, slots.example, slots.counts, self.batch, layout)
        if "down_proj" in self.attrs:
            a, b = (z, dy) if transposed else (dy, z)
            out["down_proj"] = ExpertGrads(a, b, slots.example, slots.counts, self.batch, layout)
        if f"{first}_bias" in self.attrs:
            out[f"{first}_bias"] = _bias_grads(dh, slots, self.batch, self.experts)
        if "down_proj_bias" in self.attrs:
            out["down_proj_bias"] = _bias_grads(dy, slots, self.batch, self.experts)
        return out
