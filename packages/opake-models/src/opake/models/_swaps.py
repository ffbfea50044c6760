"""Kernel swaps on one model instance: RMSNorm and gated-MLP modules call ``opake.kernels`` ops.

Only the instance is touched: each matching module gets an instance attribute ``forward``
(a bound method) that shadows its class's ``forward``; removing the attribute restores stock
behaviour. No transformers class is modified, so other models in the process are unaffected.

The kernel backend is chosen per op through :func:`opake.core.plugins.select_kernel` — once
when the patch is applied (so an explicit choice that cannot run fails there, loudly, and the
report says what was chosen and why) and then per device type the first time a patched module
runs on it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core import ops
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.models._spec import Mlp, Norm
    from opake.patches._patcher import Patcher

__all__ = [
    "KernelSlot",
    "gated_op",
    "identify_activation",
    "modules_of_class",
    "swap_gated_mlps",
    "swap_rms_norms",
]

_MARK = "_opake_kernel_swap"


class KernelSlot:
    """One op of the kernel backends, resolved per device type on first use.

    ``backend=None`` lets :func:`~opake.core.plugins.select_kernel` choose (environment
    variable, then priority); a name forces that backend.

    >>> import torch
    >>> slot = KernelSlot("swiglu", backend="torch")
    >>> slot(torch.zeros(2), torch.ones(2)).tolist()
    [0.0, 0.0]
    """

    __slots__ = ("_impls", "backend", "op")

    def __init__(self, op: str, backend: str | None = None) -> None:
        self.op = op
        self.backend = backend
        self._impls: dict[str, Callable[..., Any]] = {}

    def choose(self, device: object) -> tuple[str, str]:
        """Select the backend for ``device`` now: ``(backend, reason)``; raises if impossible."""
        from opake.core.plugins import device_type_of, select_kernel

        choice = select_kernel(self.op, device, backend=self.backend)
        self._impls[device_type_of(device)] = choice.impl
        return choice.backend, choice.reason

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The op on ``x`` (``rms_norm``, ``swiglu`` or ``geglu``: one tensor out)."""
        impl = self._impls.get(x.device.type)
        if impl is None:
            from opake.core.plugins import select_kernel

            impl = select_kernel(self.op, x.device, backend=self.backend).impl
            self._impls[x.device.type] = impl
        out: torch.Tensor = impl(x, *args, **kwargs)  # kernel ops are registered untyped
        return out


def modules_of_class(model: torch.nn.Module, class_name: str) -> Iterator[torch.nn.Module]:
    """Every submodule whose class is called ``class_name`` (found by name, not by import)."""
    for module in model.modules():
        if type(module).__name__ == class_name:
            yield module


def identify_activation(act: Callable[[Any], Any]) -> str | None:
    """Tell ``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"`` apart by evaluating ``act``.

    Decided numerically in float64, so it does not depend on transformers' class names.
    Returns None for anything else (the MLP is then left as it is).

    >>> import torch
    >>> identify_activation(torch.nn.SiLU()), identify_activation(torch.nn.GELU("tanh"))
    ('silu', 'gelu_tanh')
    >>> identify_activation(torch.nn.ReLU()) is None
    True
    """
    import torch
    import torch.nn.functional as F

    x = torch.linspace(-6.0, 6.0, 49, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y = y.to(torch.float64)
    candidates = {
        "silu": F.silu(x),
        "gelu": F.gelu(x),
        "gelu_tanh": F.gelu(x, approximate="tanh"),
    }
    for name, ref in candidates.items():
        if torch.allclose(y, ref, rtol=0.0, atol=1e-7):
            return name
    return None


def _install(module: torch.nn.Module, forward: Callable[..., Any], patcher: Patcher) -> None:
    patcher.set_attr(module, "forward", types.MethodType(forward, module))
    patcher.set_attr(module, _MARK, True)


def _swapped(module: torch.nn.Module) -> bool:
    return bool(module.__dict__.get(_MARK, False))


@dataclass(frozen=True)
class _RmsForward:
    slot: KernelSlot
    eps_attr: str
    offset: float

    def __call__(self, module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = float(getattr(module, self.eps_attr))
        return self.slot(hidden_states, module.weight, eps=eps, offset=self.offset)


def swap_rms_norms(
    model: torch.nn.Module, norm: Norm, slot: KernelSlot, patcher: Patcher
) -> tuple[int, str | None]:
    """Route every ``norm.module`` RMSNorm through the ``rms_norm`` op: ``(count, skip reason)``."""
    if norm.kind != "rms":
        return 0, f"{norm.module} is a LayerNorm (no rms_norm kernel applies)"
    found = [m for m in modules_of_class(model, norm.module) if not _swapped(m)]
    if not found:
        return 0, f"no {norm.module} module found"
    forward = _RmsForward(slot, norm.eps, float(norm.offset))
    for module in found:
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, norm.eps):
            raise ConfigurationError(
                f"{type(module).__name__} has no 'weight' parameter or no {norm.eps!r} "
                "attribute: this transformers version changed the norm module the adapter "
                "expects. Pass kernels=False to skip kernel swaps, or update the adapter."
            )
        _install(module, forward, patcher)
    return len(found), None


@dataclass(frozen=True)
class _GatedForward:
    slot: KernelSlot
    inputs: tuple[str, ...]  # (gate_up,): one fused projection; (gate, up): two
    down: str
    kwargs: tuple[tuple[str, str], ...]

    def __call__(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if len(self.inputs) == 1:
            gate, up = getattr(module, self.inputs[0])(x).chunk(2, dim=-1)
        else:
            gate = getattr(module, self.inputs[0])(x)
            up = getattr(module, self.inputs[1])(x)
        out: torch.Tensor = getattr(module, self.down)(self.slot(gate, up, **dict(self.kwargs)))
        return out


def _gated_names(mlp: Mlp) -> tuple[tuple[str, ...], str]:
    """The input projections (``(gate_up,)`` or ``(gate, up)``) and the down projection of a
    gated MLP (``Mlp`` makes sure a gated one names them)."""
    inputs = (mlp.gate_up,) if mlp.gate_up is not None else (mlp.gate, mlp.up)
    names = tuple(name for name in inputs if name is not None)
    if len(names) != len(inputs) or mlp.down is None:
        raise ConfigurationError(f"Mlp({mlp.module!r}) does not name a gated MLP's projections.")
    return names, mlp.down


_OP_FOR_ACTIVATION: dict[tuple[str, str], tuple[str, tuple[tuple[str, str], ...]]] = {
    ("swiglu", "silu"): (ops.SWIGLU, ()),
    ("geglu", "gelu"): (ops.GEGLU, (("approximate", "none"),)),
    ("geglu", "gelu_tanh"): (ops.GEGLU, (("approximate", "tanh"),)),
}


def gated_op(mlp: Mlp, model: torch.nn.Module) -> tuple[str | None, str]:
    """The kernel op for this model's gated MLPs and the activation found, or ``(None, why)``."""
    if not mlp.gated:
        return None, f"{mlp.module} is a plain {mlp.kind.upper()} MLP (no gated kernel applies)"
    modules = list(modules_of_class(model, mlp.module))
    if not modules:
        return None, f"no {mlp.module} module found"
    acts = {identify_activation(getattr(m, mlp.act, None) or (lambda x: None)) for m in modules}
    act = next(iter(acts)) if len(acts) == 1 else None
    if act is None:
        return None, (
            f"{mlp.module}.{mlp.act} is not the activation a {mlp.kind} MLP uses "
            f"(found {sorted(str(a) for a in acts)}); left as transformers computes it"
        )
    found = _OP_FOR_ACTIVATION.get((mlp.kind, act))
    if found is None:
        return None, f"{mlp.module} uses {act}, not the activation of a {mlp.kind} MLP"
    return found[0], act


def swap_gated_mlps(
    model: torch.nn.Module, mlp: Mlp, slot: KernelSlot, patcher: Patcher, activation: str
) -> int:
    """Route every ``mlp.module`` through ``slot`` (``swiglu`` or ``geglu``); returns the count."""
    kwargs = _OP_FOR_ACTIVATION[(mlp.kind, activation)][1]
    inputs, down = _gated_names(mlp)
    forward = _GatedForward(slot, inputs, down, kwargs)
    count = 0
    for module in modules_of_class(model, mlp.module):
        if _swapped(module):
            continue
        missing = [a for a in (*inputs, down) if not hasattr(module, a)]
        if missing:
            raise ConfigurationError(
                f"{type(module).__name__} has no attribute(s) {missing}: this transformers "
                "version changed the MLP the adapter expects. Pass kernels=False to skip "
                "kernel swaps, or update the adapter."
            )
        _install(module, forward, patcher)
        count += 1
    return count
