"""Implementation of :func:`opake.dpsgd.clipping.clipped_grad`.

Per-example gradients are computed as ``vmap`` over :func:`torch.func.vjp` rather than
:func:`torch.func.grad`. ``grad`` always runs its backward with ``create_graph=True``; a vjp's
backward follows grad mode, so under the ``no_grad`` this module installs it records no
differentiable graph, and inside an outer differentiating ``torch.func`` transform it records
the graph that transform needs. The two agree to fp32 rounding; on CPU with torch 2.13 their
speed and peak memory under ``vmap`` were the same within noise (``python
tools/bench/dpsgd_step.py --engines``; figures in docs/benchmarks.md).

When the differentiated parameters are a small part of the tensors the loss receives (LoRA
adapters next to a frozen model), the functorch backward's per-operation overhead dominates.
There the per-example gradients come instead from a ``vmap``-ed *forward* over the
differentiated parameters expanded to a batch dimension (stride-0 views, no copy) and one
ordinary ``torch.autograd.grad`` of the summed per-example losses: example ``i``'s loss
depends only on copy ``i``, so the gradient w.r.t. copy ``i`` is example ``i``'s gradient,
and the backward runs on plain batched tensors. The choice only changes speed (both paths are
tested against the per-example loop); the expanded path is dropped for good if it ever fails.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OpakePrivacyWarning,
)
from opake.dpsgd.bookkeeping._engine import (
    BookkeepingInconclusiveError,
    BookkeepingMismatchError,
    BookkeepingRunner,
)
from opake.dpsgd.bookkeeping._engine import choose as choose_engine
from opake.dpsgd.bookkeeping._engine import prepare as prepare_engine
from opake.dpsgd.clipping._grads import ClipAux, ClippedGrads
from opake.dpsgd.clipping._kernel import clip_accumulate, kernel_runs_on
from opake.dpsgd.clipping._state import (
    AdaptiveClipping,
    AutoSClipping,
    ClipState,
    FixedClipping,
    GroupClipping,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ClippedGradFn", "clipped_grad"]

_log = logging.getLogger("opake.core")

_EPS = 1e-6  # added to the norm before dividing (as Opacus does): keeps C/(‖g‖+ε) finite
# expanded-forward path when differentiated numel ≤ this fraction of the other float arguments
_EXPAND_FRACTION = 0.1
_RANDOMNESS = ("error", "different", "same")
_OPTIONS = (
    "argnums",
    "has_aux",
    "clipping_norm",
    "batch_argnums",
    "microbatch_size",
    "normalize_by",
    "return_aux",
    "compute_dtype",
    "clipping_groups",
    "randomness",
    "check_unused",
    "method",
)

GroupSpec = Mapping[str, str] | Callable[[str], str] | None


def _outer_transform_differentiates() -> bool:
    """True when a ``torch.func`` grad/vjp/jvp transform is active around this call."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:  # pragma: no cover - private API moved: assume the safe default
        return False
    keys = {TransformType.Grad, TransformType.Jvp}
    return any(interp.key() in keys for interp in retrieve_all_functorch_interpreters())


def _fp32_toward_zero(factor: torch.Tensor) -> torch.Tensor:
    """Cast fp64 clipping factors to fp32, rounding toward zero (never enlarging a gradient).

    Round-to-nearest could raise a factor by half an ulp — for a subnormal factor (a gradient
    norm ~1e38 clipped to C ~0.1) that is several parts per million, enough to break
    ``‖clipped‖ ≤ C``. Rounding down keeps ``‖g‖ · factor₃₂ ≤ ‖g‖ · factor ≤ C``.
    """
    import torch

    rounded = factor.to(torch.float32)
    too_big = rounded.double() > factor
    return torch.where(too_big, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


def _as_state(clipping_norm: object) -> ClipState:
    if isinstance(clipping_norm, FixedClipping | GroupClipping | AutoSClipping | AdaptiveClipping):
        return clipping_norm
    if isinstance(clipping_norm, Mapping):
        return GroupClipping(clipping_norm)
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, int | float):
        raise InputTypeError(
            f"clipped_grad(clipping_norm={clipping_norm!r}): got a "
            f"{type(clipping_norm).__name__}; expected a positive float C, a mapping "
            "group → C (per-group bounds), AutoSClipping(...) or AdaptiveClipping(...)"
        )
    return FixedClipping(clipping_norm)


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"clipped_grad({name}={value!r}): expected a non-negative int position of a "
            "positional argument of loss_fn"
        )
    return value


class ClippedGradFn:
    """The ``grad_fn`` returned by :func:`clipped_grad` (see there for the semantics).

    ``grad_fn(*args, state=state)`` → ``(grads, new_state)``, or ``((grads, aux), new_state)``
    when built with ``return_aux=True``. Keyword-only extras:

    - ``end_step`` (default ``True``): close the logical step (adaptive clipping updates C).
      Pass ``False`` for every physical batch but the last when accumulating gradients.
    - ``example_mask``: optional ``[B]`` bool tensor; ``False`` rows (padding of a fixed-shape
      batch) contribute exactly zero and are not counted anywhere.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        argnums: int,
        has_aux: bool,
        batch_argnums: tuple[int, ...],
        microbatch_size: int | None,
        normalize_by: float,
        return_aux: bool,
        compute_dtype: torch.dtype | None,
        clipping_groups: GroupSpec,
        randomness: str,
        kind: type,
        check_unused: bool,
        method: str = "vmap",
        bookkeeping: BookkeepingRunner | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.method = method
        self._bookkeeping = bookkeeping
        #: engine of the last call ("vmap" or "bookkeeping") and why it was chosen
        self.engine: str | None = None
        self.engine_reason: str | None = None
        self.argnums = argnums
        self.has_aux = has_aux
        self.batch_argnums = batch_argnums
        self.microbatch_size = microbatch_size
        self.normalize_by = normalize_by
        self.return_aux = return_aux
        self.compute_dtype = compute_dtype
        self.clipping_groups = clipping_groups
        self.randomness = randomness
        self._kind = kind
        self._check_unused = check_unused
        self._group_cache: dict[tuple[tuple[str, ...], tuple[str, ...]], list[int]] = {}
        #: why the expanded-forward path is off for good (None: chosen per call by size)
        self._expand_disabled: str | None = None

    def __repr__(self) -> str:
        return (
            f"ClippedGradFn({getattr(self.loss_fn, '__name__', self.loss_fn)!r}, "
            f"clipping={self._kind.__name__}, argnums={self.argnums}, "
            f"batch_argnums={self.batch_argnums}, microbatch_size={self.microbatch_size})"
        )

    # ------------------------------------------------------------------ argument checks
    def _check_args(self, args: tuple[Any, ...]) -> dict[str, torch.Tensor]:
        import torch

        needed = max(self.argnums, *self.batch_argnums) + 1
        if len(args) < needed:
            raise ConfigurationError(
                f"grad_fn got {len(args)} positional argument(s); argnums={self.argnums} and "
                f"batch_argnums={self.batch_argnums} need at least {needed}"
            )
        diff = args[self.argnums]
        if not isinstance(diff, Mapping) or not diff:
            raise InputTypeError(
                f"grad_fn: argument {self.argnums} (argnums) is a {type(diff).__name__}; "
                "expected a non-empty dict from name to tensor, e.g. the params of "
                "make_functional (wrap a lone tensor as {'w': w})"
            )
        for name, value in diff.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise InputTypeError(
                    f"grad_fn: differentiated entry {name!r} is "
                    f"{getattr(value, 'dtype', type(value).__name__)}; expected a "
                    "floating-point tensor"
                )
        return dict(diff)

    def _batch_size(self, args: tuple[Any, ...]) -> int:
        import torch
        from torch.utils._pytree import tree_leaves

        sizes: set[int] = set()
        for pos in self.batch_argnums:
            leaves = [x for x in tree_leaves(args[pos]) if isinstance(x, torch.Tensor)]
            if not leaves:
                raise InputTypeError(
                    f"grad_fn: batch argument {pos} holds no tensor; batch_argnums must point at "
                    "tensors (or pytrees of tensors) whose first dimension is the batch"
                )
            for leaf in leaves:
                if leaf.dim() == 0:
                    raise ConfigurationError(
                        f"grad_fn: batch argument {pos} holds a 0-d tensor; every batched "
                        "tensor needs a leading batch dimension"
                    )
                sizes.add(int(leaf.shape[0]))
        if len(sizes) != 1:
            raise ConfigurationError(
                f"grad_fn: batch arguments {self.batch_argnums} disagree on the batch size "
                f"({sorted(sizes)}); every batched tensor must have the same first dimension"
            )
        return sizes.pop()

    def _groups(self, names: tuple[str, ...], state: GroupClipping) -> list[int]:
        group_names = tuple(state.clipping_norms)
        key = (names, group_names)
        if key in self._group_cache:
            return self._group_cache[key]
        spec = self.clipping_groups
        index = {g: i for i, g in enumerate(group_names)}
        assigned: list[int] = []
        unassigned: list[str] = []
        for name in names:
            if spec is None:
                matches = [g for g in group_names if g in {"", name} or name.startswith(g + ".")]
                group = max(matches, key=len) if matches else None
            elif isinstance(spec, Mapping):
                group = spec.get(name)
            else:
                group = spec(name)
            if group is None:
                unassigned.append(name)
                continue
            if group not in index:
                close = difflib.get_close_matches(str(group), group_names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigurationError(
                    f"group clipping: parameter {name!r} is assigned to group {group!r}, which "
                    f"has no bound in clipping_norm (groups: {list(group_names)}){hint}"
                )
            assigned.append(index[group])
        if unassigned:
            raise ConfigurationError(
                f"group clipping: parameter(s) {unassigned[:5]} belong to no group of "
                f"{list(group_names)}; every differentiated parameter needs a bound (add a "
                "catch-all group '' or map them in clipping_groups)"
            )
        unused = [g for g, i in index.items() if i not in assigned]
        if unused:
            raise ConfigurationError(
                f"group clipping: group(s) {unused} match no differentiated parameter; remove "
                "them (they would inflate the sensitivity) or fix the group names"
            )
        self._group_cache[key] = assigned
        return assigned

    # ------------------------------------------------------------------ per-example pass
    def _checked(self, out: Any) -> tuple[torch.Tensor, Any]:
        """Split ``loss_fn``'s output into ``(loss, aux)`` and check the loss is one scalar."""
        import torch

        if self.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConfigurationError(
                    f"loss_fn returned a {type(out).__name__}; with has_aux=True it must "
                    "return a pair (loss, aux)"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
            raise ConfigurationError(
                f"loss_fn returned {shape} for one example; expected a scalar loss tensor "
                "(loss_fn sees a single example without batch dimension; reduce over tokens "
                "inside it, and return model(...).loss rather than the output object)"
            )
        if not loss.is_floating_point():
            raise ConfigurationError(f"loss_fn returned a {loss.dtype} loss; expected float")
        return loss, aux

    def _per_example_fn(self) -> Callable[..., Any]:
        import torch

        argnums, has_aux, loss_fn, check = self.argnums, self.has_aux, self.loss_fn, self._checked

        def per_example(*args: Any) -> Any:
            def f(diff: dict[str, torch.Tensor]) -> Any:
                call = list(args)
                call[argnums] = diff
                loss, aux = check(loss_fn(*call))
                return (loss, aux) if has_aux else loss

            out: Any = torch.func.vjp(f, args[argnums], has_aux=has_aux)
            loss, vjp_fn = out[0], out[1]
            (grads,) = vjp_fn(torch.ones_like(loss))
            if has_aux:
                return grads, loss, out[2]
            return grads, loss

        return per_example

    def _prefer_expanded(self, args: tuple[Any, ...], differentiable: bool) -> bool:
        """Use the expanded-forward path? Only when the differentiated part is small."""
        import torch
        from torch.utils._pytree import tree_leaves

        if differentiable or self._expand_disabled is not None:
            return False
        diff = sum(v.numel() for v in args[self.argnums].values())
        other = sum(
            x.numel()
            for i, arg in enumerate(args)
            if i != self.argnums and i not in self.batch_argnums
            for x in tree_leaves(arg)
            if isinstance(x, torch.Tensor) and x.is_floating_point()
        )
        return diff <= _EXPAND_FRACTION * other

    def _expanded_per_example(self, args: tuple[Any, ...], m: int) -> Any:
        """Per-example gradients from a vmapped forward over expanded parameters (see above)."""
        import torch
        from torch.utils._pytree import tree_map

        leaves = {
            name: value.detach().unsqueeze(0).expand(m, *value.shape).requires_grad_(True)
            for name, value in args[self.argnums].items()
        }
        call = list(args)
        call[self.argnums] = leaves
        in_dims = tuple(
            0 if i == self.argnums or i in self.batch_argnums else None for i in range(len(args))
        )
        loss_fn, check = self.loss_fn, self._checked

        def one(*example: Any) -> Any:
            loss, aux = check(loss_fn(*example))
            return (loss, aux) if self.has_aux else loss

        with torch.enable_grad():
            out = torch.func.vmap(one, in_dims=in_dims, randomness=self.randomness)(*call)
            loss, aux = out if self.has_aux else (out, None)
            grads = torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)
        per_example = {
            name: torch.zeros_like(leaf) if grad is None else grad
            for (name, leaf), grad in zip(leaves.items(), grads, strict=True)
        }
        detached = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        if self.has_aux:
            return per_example, loss.detach(), detached
        return per_example, loss.detach()

    def _warn_unused(self, args: tuple[Any, ...], diff: dict[str, torch.Tensor]) -> None:
        """Warn (once) about differentiated leaves the loss does not depend on at all."""
        import torch
        from torch.utils._pytree import tree_map

        call = list(args)
        for pos in self.batch_argnums:
            call[pos] = tree_map(lambda x: x[0] if isinstance(x, torch.Tensor) else x, args[pos])
        leaves = {name: value.detach().requires_grad_(True) for name, value in diff.items()}
        call[self.argnums] = leaves
        with torch.enable_grad():
            out = self.loss_fn(*call)
            loss = out[0] if self.has_aux else out
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        unused = [name for name, g in zip(leaves, grads, strict=True) if g is None]
        if unused:
            warnings.warn(
                f"clipped_grad: the loss does not depend on differentiated parameter(s) "
                f"{unused[:10]}; they receive no gradient and would be trained on noise alone. "
                "Freeze them (requires_grad_(False) before make_functional(..., "
                "partition_trainable=True)) or drop them from the differentiated dict.",
                OpakePrivacyWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ the call
    def __call__(
        self,
        *args: Any,
        state: ClipState,
        end_step: bool = True,
        example_mask: torch.Tensor | None = None,
    ) -> Any:
        """Clipped, summed per-example gradients of ``loss_fn`` over the batch arguments."""
        import torch
        from torch.utils._pytree import tree_map

        if not isinstance(state, self._kind):
            raise ConfigurationError(
                f"grad_fn(state=...): got a {type(state).__name__}; this grad_fn was built for "
                f"{self._kind.__name__}: pass the state returned by clipped_grad or by the "
                "previous grad_fn call"
            )
        diff = self._check_args(args)
        batch = self._batch_size(args)
        names = tuple(diff)
        first = next(iter(diff.values()))
        device = first.device
        groups = self._groups(names, state) if isinstance(state, GroupClipping) else None
        if example_mask is not None:
            if (
                not isinstance(example_mask, torch.Tensor)
                or example_mask.dtype != torch.bool
                or tuple(example_mask.shape) != (batch,)
            ):
                raise InputTypeError(
                    f"grad_fn(example_mask=...): expected a bool tensor of shape ({batch},), "
                    f"got {getattr(example_mask, 'dtype', type(example_mask))} "
                    f"{tuple(getattr(example_mask, 'shape', ()))}"
                )
            example_mask = example_mask.to(device)
        differentiable = _outer_transform_differentiates()

        if self.compute_dtype is not None:
            dtype = self.compute_dtype

            def cast(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(dtype)
                return x

            args = tuple(tree_map(cast, a) for a in args)

        # a small differentiated part: the vmap engine's expanded forward, which "auto" prefers
        expanded = self._prefer_expanded(args, differentiable)
        bk, self.engine_reason = choose_engine(
            self._bookkeeping,
            self.method,
            names,
            differentiable=differentiable,
            randomness=self.randomness,
            small=self.method == "auto" and expanded,
        )
        run = functools.partial(
            self._run,
            args,
            state=state,
            batch=batch,
            names=names,
            device=device,
            groups=groups,
            example_mask=example_mask,
            differentiable=differentiable,
            expanded=expanded,
        )
        context = contextlib.nullcontext() if differentiable else torch.no_grad()
        with context:
            try:
                result = run(bk=bk)
            except BookkeepingMismatchError as err:  # the check failed: "auto" falls back
                if self.method == "bookkeeping":
                    raise
                _log.warning("clipped_grad: %s; using the vmap engine from now on", err)
                bk, self.engine_reason = None, str(err)
                result = run()
            except BookkeepingInconclusiveError as err:  # never an unchecked result
                level = logging.WARNING if self.method == "bookkeeping" else logging.INFO
                _log.log(level, "clipped_grad: %s; this call uses the vmap engine", err)
                bk, self.engine_reason = None, str(err)
                result = run()
        self.engine = "vmap" if bk is None else "bookkeeping"
        sums, aux, centred = result
        if self._check_unused and batch > 0 and not differentiable:
            self._check_unused = False
            self._warn_unused(args, dict(args[self.argnums]))
        new_state: ClipState = state
        if isinstance(state, AdaptiveClipping):
            new_state = state.add_count(centred)
            if end_step:
                new_state = new_state.end_step()
        elif not isinstance(end_step, bool):
            raise InputTypeError(f"grad_fn(end_step={end_step!r}): expected True or False")
        grads = ClippedGrads(
            sums, max_norm=state.sensitivity / self.normalize_by, batch_size=aux.batch_size
        )
        # adaptive clipping also released a noisy count: the optimizer must account for it
        grads.count_noise_multiplier = getattr(state, "count_noise_multiplier", None)
        if self.return_aux:
            return (grads, aux), new_state
        return grads, new_state

    def _run(
        self,
        args: tuple[Any, ...],
        *,
        state: ClipState,
        batch: int,
        names: tuple[str, ...],
        device: torch.device,
        groups: list[int] | None,
        example_mask: torch.Tensor | None,
        differentiable: bool,
        expanded: bool,
        bk: BookkeepingRunner | None = None,
    ) -> tuple[dict[str, torch.Tensor], ClipAux, torch.Tensor]:
        import torch
        from torch.utils._pytree import tree_map

        diff = args[self.argnums]
        sums = {
            name: torch.zeros(diff[name].shape, dtype=torch.float32, device=device)
            for name in names
        }
        f32 = torch.float32
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        clipped_norms: list[torch.Tensor] = []
        group_norms: list[torch.Tensor] = []
        aux_parts: list[Any] = []
        scaled = torch.zeros((), dtype=torch.int64, device=device)
        nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        centred = torch.zeros((), dtype=torch.float64, device=device)
        real_total = (
            torch.tensor(batch, dtype=torch.int64, device=device)
            if example_mask is None
            else example_mask.sum()
        )
        in_dims = tuple(0 if i in self.batch_argnums else None for i in range(len(args)))
        vmapped = torch.func.vmap(
            self._per_example_fn(), in_dims=in_dims, randomness=self.randomness
        )
        step = self.microbatch_size or batch
        for start in range(0, batch, step or 1):
            stop = min(start + step, batch)
            if start == 0 and stop == batch:
                chunk_args = args
            else:
                chunk_args = tuple(
                    tree_map(
                        lambda x, a=start, b=stop: x[a:b] if isinstance(x, torch.Tensor) else x,
                        arg,
                    )
                    if i in self.batch_argnums
                    else arg
                    for i, arg in enumerate(args)
                )
            m = stop - start
            if bk is not None:  # book-keeping: norms from one batched backward, no grads
                chunk = bk.run_checked(
                    chunk_args, m, self.loss_fn, check=self.randomness == "error"
                )
                loss, leaf_sq = chunk.loss, chunk.leaf_sq
                # clip with bounds that rounding cannot shrink (see _bk_certify)
                bound_sq = leaf_sq if chunk.clip_sq is None else chunk.clip_sq
                if self.has_aux:
                    aux_parts.append(chunk.aux)
            else:
                out = None
                if expanded:
                    try:
                        out = self._expanded_per_example(chunk_args, m)
                    except (RuntimeError, NotImplementedError) as err:  # e.g. no batching rule
                        self._expand_disabled = f"{type(err).__name__}: {err}"
                        expanded = False
                if out is None:
                    out = vmapped(*chunk_args)
                grads, loss = out[0], out[1]
                if self.has_aux:
                    aux_parts.append(out[2])
                # per-leaf L2 norms in fp32, combined in fp64 so that the sum of squares cannot
                # overflow for finite leaf norms
                leaf_sq = torch.stack(
                    [
                        torch.linalg.vector_norm(
                            grads[n].reshape(m, -1),
                            dim=1,
                            dtype=torch.promote_types(grads[n].dtype, f32),
                        )
                        .double()
                        .square()
                        for n in names
                    ],
                    dim=1,
                )
                bound_sq = leaf_sq  # the norms of the very tensors that are summed
            total = leaf_sq.sum(dim=1).sqrt()
            bound = bound_sq.sum(dim=1).sqrt()
            finite = torch.isfinite(total) & torch.isfinite(bound)
            is_real = (
                torch.ones(m, dtype=torch.bool, device=device)
                if example_mask is None
                else example_mask[start:stop]
            )
            contributes = finite & is_real
            if isinstance(state, GroupClipping):
                assert groups is not None
                index = torch.tensor(groups, device=device)
                k = len(state.clipping_norms)
                empty = torch.zeros(m, k, dtype=torch.float64, device=device)
                per_group = empty.index_add(1, index, leaf_sq).sqrt()
                group_bound = empty.index_add(1, index, bound_sq).sqrt()
                bounds = torch.tensor(
                    list(state.clipping_norms.values()), dtype=torch.float64, device=device
                )
                factor = (bounds / (group_bound + _EPS)).clamp(max=1.0)
                factor = torch.where(contributes[:, None], factor, 0.0)
                after = (per_group * factor).square().sum(dim=1).sqrt()
                shrunk = (factor < 1.0).any(dim=1)
                leaf_factor = _fp32_toward_zero(factor)[:, index]  # [m, leaves]
                group_norms.append(per_group.to(f32))
            else:
                if isinstance(state, AutoSClipping):
                    factor = state.clipping_norm / (bound + state.stability)
                else:
                    factor = (state.clipping_norm / (bound + _EPS)).clamp(max=1.0)
                factor = torch.where(contributes, factor, 0.0)
                after = total * factor
                shrunk = factor < 1.0
                leaf_factor = _fp32_toward_zero(factor)[:, None].expand(m, len(names))
                if isinstance(state, AdaptiveClipping):
                    below = (bound <= state.clipping_norm) & finite
                    weight = torch.where(is_real, below.double() - 0.5, 0.0)
                    centred = centred + weight.sum()
            after = torch.where(contributes, after, 0.0)
            nonfinite = nonfinite + (is_real & ~finite).sum()
            scaled = scaled + (is_real & shrunk).sum()
            if bk is not None:
                for name, contrib in chunk.weighted(names, leaf_factor, contributes, sums).items():
                    sums[name].add_(contrib)
                names_vmap: tuple[str, ...] = ()
            else:
                names_vmap = names
            if names_vmap and not differentiable and kernel_runs_on(device):
                # fused multi-tensor scale-and-sum (Triton): one launch for every leaf
                clip_accumulate(
                    [grads[n] for n in names_vmap], leaf_factor, [sums[n] for n in names_vmap]
                )
                names_vmap = ()
            for j, name in enumerate(names_vmap):
                g = grads[name].reshape(m, -1).to(f32)
                # a non-finite example has factor 0, but 0·NaN = NaN: zero its entries first
                # (in place when that is safe: a contiguous tensor this call owns)
                if differentiable or not g.is_contiguous():
                    g = g.nan_to_num(0.0, 0.0, 0.0)
                else:
                    g.nan_to_num_(0.0, 0.0, 0.0)
                contrib = (leaf_factor[:, j] @ g).reshape(sums[name].shape)
                sums[name] = sums[name] + contrib if differentiable else sums[name].add_(contrib)
            losses.append(loss.detach().to(f32) if not differentiable else loss.to(f32))
            norms.append(total.to(f32))
            clipped_norms.append(after.to(f32))
        if self.normalize_by != 1.0:
            sums = {name: value / self.normalize_by for name, value in sums.items()}

        def cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
            if not parts:
                return torch.zeros(0, dtype=f32, device=device)
            return parts[0] if len(parts) == 1 else torch.cat(list(parts))

        loss_aux: Any = None
        if aux_parts:
            loss_aux = (
                aux_parts[0]
                if len(aux_parts) == 1
                else tree_map(lambda *xs: torch.cat(xs), *aux_parts)
            )
        rate = torch.where(real_total > 0, scaled.to(f32) / real_total.clamp(min=1).to(f32), 0.0)
        aux = ClipAux(
            loss_values=cat(losses),
            grad_norms=cat(norms),
            clipped_grad_norms=cat(clipped_norms),
            clipping_rate=rate,
            batch_size=real_total,
            nonfinite_count=nonfinite,
            loss_aux=loss_aux,
            group_grad_norms=(
                {
                    g: cat(group_norms)[:, k] if group_norms else torch.zeros(0, device=device)
                    for k, g in enumerate(state.clipping_norms)
                }
                if isinstance(state, GroupClipping)
                else None
            ),
        )
        return sums, aux, centred


def clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int = 0,
    has_aux: bool = False,
    *,
    clipping_norm: float | Mapping[str, float] | ClipState,
    batch_argnums: int | tuple[int, ...] = 1,
    microbatch_size: int | None = None,
    normalize_by: float = 1.0,
    return_aux: bool = False,
    compute_dtype: torch.dtype | None = None,
    clipping_groups: GroupSpec = None,
    randomness: str = "error",
    check_unused: bool = True,
    method: str = "auto",
    **unknown: Any,
) -> tuple[ClippedGradFn, ClipState]:
    """Build ``grad_fn``: the sum of per-example gradients, each clipped, in fp32.

    ``loss_fn(*args)`` computes the loss of **one** example: the arguments at ``batch_argnums``
    reach it without their batch dimension (through :func:`torch.func.vmap`), the others
    (parameters, frozen weights, constants) as given. ``grad_fn(*args, state=state)`` returns
    ``(grads, new_state)``: ``grads`` is a :class:`ClippedGrads` dict with the keys of
    ``args[argnums]`` holding ``Σ_i clip(∇ loss_fn(example i)) / normalize_by`` in fp32, and
    ``grads.max_norm`` its L2 sensitivity (the std of DP noise is ``σ · grads.max_norm``).

    Args:
        loss_fn: per-example loss; returns a scalar tensor, or ``(loss, aux)`` with ``has_aux``.
        argnums: position of the differentiated argument, a dict name → tensor (e.g.
            ``trainable`` from :func:`opake.functional.make_functional`).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (a pytree of tensors) is stacked
            over the batch into ``ClipAux.loss_aux``.
        clipping_norm: the clipping method — a float C (fixed), a mapping group → C_k
            (:class:`GroupClipping`, sensitivity ``sqrt(Σ C_k²)``), :class:`AutoSClipping` or
            :class:`AdaptiveClipping`. Also the initial ``state``.
        batch_argnums: position(s) of the batched arguments (tensors or pytrees of tensors
            whose first dimension is the batch).
        microbatch_size: process the batch in chunks of this many examples (the last may be
            smaller) with a running fp32 sum; same result, less memory. ``None``: one chunk.
        normalize_by: divide the sum by this (e.g. the expected batch size); the sensitivity
            is divided too.
        return_aux: return ``((grads, aux), new_state)`` with a :class:`ClipAux`
            (per-example losses and norms — not private).
        compute_dtype: run the per-example forward/backward in this dtype (every
            floating-point tensor argument is cast; one already in this dtype is not copied,
            so keep a large frozen model in it); norms, clipping and sums stay fp32.
        clipping_groups: for group clipping, parameter name → group: a mapping or a callable;
            by default a group name is a dotted prefix of the parameter names it covers
            (longest match wins, ``""`` matches everything).
        randomness: ``vmap`` randomness (``"different"`` for dropout in training mode).
        check_unused: on the first call, warn (:class:`~opake.core.errors.OpakePrivacyWarning`)
            about differentiated parameters the loss does not depend on (one extra
            single-example backward).
        method: the per-example engine — ``"vmap"`` (per-example gradients by ``vmap``),
            ``"bookkeeping"`` (norms and the clipped sum from one ordinary batched backward;
            needs ``loss_fn`` to be a :class:`~opake.dpsgd.bookkeeping.BatchedLoss`, see
            :mod:`opake.dpsgd.bookkeeping`) or ``"auto"`` (book-keeping where every
            differentiated parameter has a rule and its first-call check passes, unless the
            differentiated parameters are at most a tenth of the other floating-point
            arguments, e.g. LoRA adapters, where vmap is cheaper; vmap otherwise;
            ``grad_fn.engine``/``grad_fn.engine_reason`` report the choice).

    Semantics: an example's gradient covers all differentiated leaves together. An example
    with a NaN/Inf gradient entry (or a norm beyond fp32 range) contributes zero and is
    counted in ``ClipAux.nonfinite_count``; the bound holds regardless. An empty batch gives
    zero gradients. The call runs under ``torch.no_grad()`` unless an outer ``torch.func``
    transform differentiates through it. Nothing mixes examples before clipping.

    Example:
        >>> import torch
        >>> from opake.dpsgd.clipping import clipped_grad
        >>> def loss_fn(params, x, y):  # one example: x [3], y []
        ...     return (params["w"] @ x - y) ** 2
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2))
        >>> params = {"w": torch.zeros(3)}
        >>> x, y = torch.ones(4, 3), torch.full((4,), 10.0)
        >>> grads, state = grad_fn(params, x, y, state=state)
        >>> grads["w"]  # four examples, each clipped from norm ≈ 34.6 to 1
        tensor([-2.3094, -2.3094, -2.3094])
        >>> grads.max_norm
        1.0
    """
    if unknown:
        name = next(iter(unknown))
        close = difflib.get_close_matches(name, _OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(
            f"clipped_grad() got an unknown keyword argument {name!r}{hint}; accepted: "
            f"{', '.join(_OPTIONS)}"
        )
    if not callable(loss_fn):
        raise InputTypeError(
            f"clipped_grad(loss_fn={loss_fn!r}): expected a callable computing one example's loss"
        )
    argnums = _check_index("argnums", argnums)
    batch: tuple[int, ...]
    if isinstance(batch_argnums, int):
        batch = (_check_index("batch_argnums", batch_argnums),)
    elif isinstance(batch_argnums, tuple) and batch_argnums:
        batch = tuple(_check_index("batch_argnums", b) for b in batch_argnums)
    else:
        raise ConfigurationError(
            f"clipped_grad(batch_argnums={batch_argnums!r}): expected an int or a non-empty "
            "tuple of ints"
        )
    if len(set(batch)) != len(batch) or argnums in batch:
        raise ConfigurationError(
            f"clipped_grad(argnums={argnums}, batch_argnums={batch_argnums!r}): positions must "
            "be distinct and the differentiated argument cannot be batched"
        )
    if microbatch_size is not None and (
        isinstance(microbatch_size, bool)
        or not isinstance(microbatch_size, int)
        or microbatch_size < 1
    ):
        raise ConfigurationError(
            f"clipped_grad(microbatch_size={microbatch_size!r}): expected a positive int or None"
        )
    if (
        isinstance(normalize_by, bool)
        or not isinstance(normalize_by, int | float)
        or not (0 < float(normalize_by) < math.inf)
    ):
        raise ConfigurationError(
            f"clipped_grad(normalize_by={normalize_by!r}): expected a positive finite number "
            "(e.g. the expected batch size)"
        )
    for flag, value in (
        ("has_aux", has_aux),
        ("return_aux", return_aux),
        ("check_unused", check_unused),
    ):
        if not isinstance(value, bool):
            raise InputTypeError(f"clipped_grad({flag}={value!r}): expected True or False")
    if randomness not in _RANDOMNESS:
        raise ConfigurationError(
            f"clipped_grad(randomness={randomness!r}): expected one of {_RANDOMNESS}"
        )
    if compute_dtype is not None:
        import torch

        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ConfigurationError(
                f"clipped_grad(compute_dtype={compute_dtype!r}): expected a floating torch.dtype "
                "such as torch.bfloat16, or None"
            )
    loss_fn, bookkeeping = prepare_engine(
        loss_fn, method, argnums=argnums, batch_argnums=batch, has_aux=has_aux
    )
    state = _as_state(clipping_norm)
    if clipping_groups is not None and not isinstance(state, GroupClipping):
        raise ConfigurationError(
            "clipped_grad(clipping_groups=...) only applies to group clipping; pass "
            "clipping_norm as a mapping group → bound"
        )
    if clipping_groups is not None and not (
        isinstance(clipping_groups, Mapping) or callable(clipping_groups)
    ):
        raise InputTypeError(
            f"clipped_grad(clipping_groups={clipping_groups!r}): expected a mapping or callable "
            "parameter name → group name"
        )
    grad_fn = ClippedGradFn(
        loss_fn,
        argnums=argnums,
        has_aux=has_aux,
        batch_argnums=batch,
        microbatch_size=microbatch_size,
        normalize_by=float(normalize_by),
        return_aux=return_aux,
        compute_dtype=compute_dtype,
        clipping_groups=clipping_groups,
        randomness=randomness,
        kind=type(state),
        check_unused=check_unused,
        method=str(method),
        bookkeeping=bookkeeping,
    )
    return grad_fn, state
