"""Optimizer-state CPU offload for :class:`opake.dpsgd.optimizer.DPOptimizer`.

The wrapped optimizer is re-pointed at CPU *staging* copies of its parameters, so every state
tensor it creates (Adam's moments, momentum buffers) lives in CPU memory. A step copies each
parameter to its staging copy, writes the (already noised) gradient there, runs the optimizer's
own update on the CPU and copies the result back. The update is the same computation on the same
values, and the noise was added before it: offloading changes where the arithmetic runs, not what
is released (DP-neutral). Copies are blocking, so no transfer races the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CPUStateOffload"]


class CPUStateOffload:
    """Re-home ``optimizer`` onto CPU staging copies of the named parameters.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([w], lr=0.5)
        >>> offload = CPUStateOffload(opt, {"w": w})
        >>> offload.step({"w": torch.ones(2)})
        >>> w.detach(), opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].device.type
        (tensor([0.5000, 0.5000]), 'cpu')
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]):
        import torch

        self.optimizer = optimizer
        self.params = dict(params)
        pin = torch.cuda.is_available()
        self.masters: dict[str, torch.Tensor] = {}
        by_id = {id(p): name for name, p in self.params.items()}
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                name = by_id[id(p)]
                master = torch.empty(
                    p.shape, dtype=p.dtype, device="cpu", pin_memory=pin and p.is_cuda
                )
                with torch.no_grad():
                    master.copy_(p.detach())
                old_state = optimizer.state.pop(p, None)
                if old_state:
                    optimizer.state[master] = {
                        k: v.to("cpu") if isinstance(v, torch.Tensor) else v
                        for k, v in old_state.items()
                    }
                group["params"][i] = master
                self.masters[name] = master

    def reset_masters(self) -> None:
        """Move optimizer state that a ``load_state_dict`` put elsewhere back to the CPU."""
        import torch

        for master in self.masters.values():
            state = self.optimizer.state.get(master)
            if state:
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                        state[key] = value.to("cpu")

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Stage parameters and gradients on the CPU, step there, copy parameters back."""
        import torch

        with torch.no_grad():
            for name, master in self.masters.items():
                master.copy_(self.params[name].detach())
                grad = grads.get(name)
                master.grad = None if grad is None else grad.to(device="cpu", dtype=master.dtype)
                self.params[name].grad = None
            self.optimizer.step()
            for name, master in self.masters.items():
                if name in grads:
                    self.params[name].copy_(master)
                master.grad = None
