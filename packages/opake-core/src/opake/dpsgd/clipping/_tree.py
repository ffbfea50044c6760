"""The differentiated argument as a pytree: named leaves inside, the user's structure outside.

Internally both engines work on a dict leaf name → tensor. A flat dict with string keys (the
``trainable`` dict of :func:`~opake.functional.make_functional`) is used as it is; any other
pytree of tensors (a lone tensor, a tuple, a list, a nested dict) is flattened with
``torch.utils._pytree``, its leaves named by their path (``"0"``, ``"encoder.w"``, ``""`` for a
lone tensor), and rebuilt before ``loss_fn`` sees it and for the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["DiffTree"]


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class DiffTree:
    """The structure of one differentiated argument and its leaves by name.

    >>> import torch
    >>> tree = DiffTree.of((torch.zeros(2), {"b": torch.ones(1)}), argnums=0)
    >>> tree.names
    ('0', '1.b')
    >>> tree.rebuild({"0": torch.ones(2), "1.b": torch.zeros(1)})
    (tensor([1., 1.]), {'b': tensor([0.])})
    """

    def __init__(self, leaves: dict[str, torch.Tensor], spec: Any) -> None:
        self.leaves = leaves
        self.names = tuple(leaves)
        self._spec = spec  # None: a flat dict, used as it is

    @property
    def plain(self) -> bool:
        """A flat dict name → tensor (no flattening; what book-keeping needs)."""
        return self._spec is None

    @classmethod
    def of(cls, diff: object, *, argnums: int) -> DiffTree:
        """Validate and flatten; bad leaves raise :class:`InputTypeError` saying how to fix."""
        import torch
        from torch.utils._pytree import tree_flatten_with_path

        if (
            isinstance(diff, Mapping)
            and diff
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in diff.items())
        ):
            leaves = dict(diff)
            cls._check(leaves, argnums)
            return cls(leaves, None)
        flat, spec = tree_flatten_with_path(diff)
        if not flat:
            raise InputTypeError(
                f"grad_fn: argument {argnums} (argnums) is an empty {type(diff).__name__}; "
                "expected a tensor or a non-empty pytree (dict, tuple, list) of tensors, e.g. "
                "the params of make_functional"
            )
        leaves = {".".join(_key_name(k) for k in path): leaf for path, leaf in flat}
        if len(leaves) != len(flat):
            raise InputTypeError(
                f"grad_fn: argument {argnums} (argnums) has leaves whose paths collide when "
                "joined with '.'; use a flat dict name → tensor"
            )
        cls._check(leaves, argnums)
        return cls(leaves, spec)

    @staticmethod
    def _check(leaves: Mapping[str, object], argnums: int) -> None:
        import torch

        for name, value in leaves.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                what = getattr(value, "dtype", type(value).__name__)
                raise InputTypeError(
                    f"grad_fn: differentiated entry {name!r} of argument {argnums} (argnums) is "
                    f"{what}; expected a floating-point tensor (pass constants and integer "
                    "tensors as other arguments of loss_fn, not inside the differentiated one)"
                )

    def rebuild(self, leaves: Mapping[str, torch.Tensor]) -> Any:  # Any: the caller's pytree
        """The user's structure with these leaves (a dict for a plain tree). Any: that
        structure is the caller's pytree, known only at the call."""
        if self._spec is None:
            return dict(leaves)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten([leaves[n] for n in self.names], self._spec)

    def wrap(self, loss_fn: Callable[..., Any], argnums: int) -> Callable[..., Any]:
        """``loss_fn`` taking the named leaves at ``argnums`` (itself for a plain tree)."""
        if self._spec is None:
            return loss_fn
        rebuild = self.rebuild

        def on_leaves(*args: Any) -> object:
            call = list(args)
            call[argnums] = rebuild(call[argnums])
            return loss_fn(*call)

        on_leaves.__name__ = getattr(loss_fn, "__name__", "loss_fn")
        return on_leaves
