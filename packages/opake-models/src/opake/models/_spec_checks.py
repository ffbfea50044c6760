"""Shared vocabulary and validators of the family spec's descriptors.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re

from opake.core.errors import ConfigurationError

__all__ = [
    "MLP_KINDS",
    "NORM_KINDS",
    "NORM_PLACEMENTS",
    "ROPE_KINDS",
    "ROUTINGS",
    "TASKS",
    "choice",
    "ident",
    "optional_ident",
]

MLP_KINDS: tuple[str, ...] = ("swiglu", "geglu", "gelu")
#: RMSNorm (``x / rms(x) · w``, optionally ``· (offset + w)``) or LayerNorm (mean subtracted)
NORM_KINDS: tuple[str, ...] = ("rms", "layer")
#: where the norms sit around the residual adds of one block
NORM_PLACEMENTS: tuple[str, ...] = (
    "pre",  # norm → sublayer → + residual (Llama)
    "post",  # sublayer → norm → + residual (OLMo 2)
    "sandwich",  # norm → sublayer → norm → + residual (Gemma 2)
    "parallel",  # one norm feeding attention and MLP side by side (Cohere)
    "post_residual",  # sublayer → + residual → norm (BERT)
)
#: rotary embedding styles: halves rotated, pairs interleaved, or no rotary (learned positions)
ROPE_KINDS: tuple[str, ...] = ("rotate_half", "interleaved", "none")
#: how a router turns its logits into top-k expert weights (see :class:`Moe`)
ROUTINGS: tuple[str, ...] = (
    "softmax_topk",  # softmax over all experts, top-k, optionally renormalised (Mixtral, Qwen)
    "topk_softmax",  # top-k logits, softmax over those k (GPT-OSS)
    "family",  # only the family's own router code (book-keeping reports it unsupported)
)
#: the model heads a family adapter supports
TASKS: tuple[str, ...] = ("causal_lm", "sequence_classification")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def choice(owner: str, what: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is one of ``allowed``.

    >>> choice("Norm('x')", "kind", "rms", NORM_KINDS)
    """
    if value not in allowed:
        raise ConfigurationError(f"{owner}: {what}={value!r} is not one of {allowed}.")


def ident(owner: str, what: str, value: object, *, path: bool = False) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is an identifier (``path``: a dotted
    attribute path such as ``model.layers``)."""
    pattern = _PATH if path else _IDENT
    if not isinstance(value, str) or not pattern.match(value):
        kind = "a dotted attribute path such as 'model.layers'" if path else "an identifier"
        raise ConfigurationError(f"{owner}: {what}={value!r} is not {kind}.")


def optional_ident(owner: str, what: str, value: object) -> None:
    """:func:`ident`, allowing None."""
    if value is not None:
        ident(owner, what, value)
