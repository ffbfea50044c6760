"""The parts of a decoder layer a family spec declares: MLP, norm, rotary embedding, attention.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._spec_checks import (
    MLP_KINDS,
    NORM_KINDS,
    NORM_PLACEMENTS,
    ROPE_KINDS,
    choice,
    ident,
    optional_ident,
)

__all__ = ["Attention", "Mlp", "Norm", "Rope"]


@dataclass(frozen=True)
class Mlp:
    """The feed-forward block of a decoder layer.

    Args:
        kind: ``"swiglu"``, ``"geglu"`` (gated; a kernel may replace the gate product) or
            ``"gelu"`` (plain two-layer MLP; left as transformers wrote it).
        module: class name of the MLP module (``"LlamaMLP"``).
        gate: attribute name of the gate projection.
        up: attribute name of the up projection.
        down: attribute name of the down projection (None for a plain MLP whose output
            projection lives in another module, as in BERT).
        gate_up: attribute of a fused projection whose output is ``[gate | up]`` (Phi-3);
            replaces ``gate`` and ``up``.
        act: attribute holding the activation module; the adapter checks numerically that it
            is the activation ``kind`` implies before swapping in a kernel.

    Example:
        >>> Mlp("swiglu", "LlamaMLP").gated
        True
    """

    kind: Literal["swiglu", "geglu", "gelu"]
    module: str
    gate: str | None = "gate_proj"
    up: str | None = "up_proj"
    down: str | None = "down_proj"
    gate_up: str | None = None
    act: str = "act_fn"

    def __post_init__(self) -> None:
        owner = f"Mlp({self.module!r})"
        choice(owner, "kind", self.kind, MLP_KINDS)
        ident(owner, "module", self.module)
        for what in ("gate", "up", "down", "gate_up"):
            optional_ident(owner, what, getattr(self, what))
        ident(owner, "act", self.act)
        if self.gated:
            if self.gate_up is None and (self.gate is None or self.up is None):
                raise ConfigurationError(f"{owner}: a gated MLP needs gate and up, or gate_up.")
            if self.down is None:
                raise ConfigurationError(f"{owner}: a gated MLP needs its down projection.")

    @property
    def gated(self) -> bool:
        """True for SwiGLU/GeGLU (``down(act(gate) * up)``)."""
        return self.kind != "gelu"


@dataclass(frozen=True)
class Norm:
    """The normalisation layers and where they sit.

    Args:
        kind: ``"rms"`` or ``"layer"``. RMSNorm modules may be replaced by the ``rms_norm``
            kernel; LayerNorm is left alone.
        module: class name of the norm module (``"LlamaRMSNorm"``, ``"LayerNorm"``).
        placement: one of :data:`NORM_PLACEMENTS`.
        eps: attribute of the module holding epsilon.
        offset: the weight offset: Gemma's RMSNorm computes ``x̂ · (1 + w)`` (``offset=1.0``).

    Example:
        >>> Norm("rms", "GemmaRMSNorm", "pre", eps="eps", offset=1.0).offset
        1.0
    """

    kind: Literal["rms", "layer"]
    module: str
    placement: str
    eps: str = "variance_epsilon"
    offset: float = 0.0

    def __post_init__(self) -> None:
        owner = f"Norm({self.module!r})"
        choice(owner, "kind", self.kind, NORM_KINDS)
        ident(owner, "module", self.module)
        choice(owner, "placement", self.placement, NORM_PLACEMENTS)
        ident(owner, "eps", self.eps)
        if isinstance(self.offset, bool) or not isinstance(self.offset, (int, float)):
            raise InputTypeError(f"{owner}: offset must be a number, got {self.offset!r}.")


@dataclass(frozen=True)
class Rope:
    """Positional encoding.

    Args:
        kind: ``"rotate_half"`` (Llama style), ``"interleaved"`` (Cohere: even/odd pairs) or
            ``"none"`` (learned absolute positions: GPT-2, BERT).
        module: class name of the rotary-embedding module (None when ``kind="none"``).
        partial: rotary applies to part of each head only (``partial_rotary_factor``).
        skip: the layers that get no rotary at all (hybrid NoPE layouts): a config attribute
            listing them (SmolLM 3 ``no_rope_layers``) or the layer type without it
            (``full_attention`` for Cohere 2 and EXAONE 4). Descriptive: transformers' own
            attention code applies it; reports and the family table show it.

    Example:
        >>> Rope("none").module is None
        True
    """

    kind: Literal["rotate_half", "interleaved", "none"]
    module: str | None = None
    partial: bool = False
    skip: str | None = None

    def __post_init__(self) -> None:
        owner = f"Rope({self.kind!r})"
        choice(owner, "kind", self.kind, ROPE_KINDS)
        optional_ident(owner, "module", self.module)
        optional_ident(owner, "skip", self.skip)
        if not isinstance(self.partial, bool):
            raise InputTypeError(f"{owner}: partial must be True or False.")
        if (self.kind == "none") != (self.module is None):
            raise ConfigurationError(
                f"{owner}: give the rotary module's class name exactly when kind is not 'none'."
            )


@dataclass(frozen=True)
class Attention:
    """Attention-mask facts: what a 2-D padding mask must become for ``vmap``.

    Args:
        mask: ``"causal"`` (decoders) or ``"bidirectional"`` (encoders).
        sliding_window: config attribute holding a sliding-window size (None: no window).
        layer_types: the backbone accepts a dict ``{layer_type: 4-D mask}`` (one mask per
            ``config.layer_types`` entry: full and sliding layers differ).
        softcap: config attribute of an attention-logit softcap (Gemma 2), applied inside
            transformers' attention; recorded so reports show it.
        qk_norm: queries and keys are normalised per head before the dot product
            (transformers' own code; descriptive).
        sinks: learned per-head attention sinks (GPT-OSS; transformers' own code, descriptive).
        linear: class name of a linear-attention block used on ``"linear_attention"`` layers
            (Qwen3-Next's gated delta net); those layers take the 2-D padding mask, the others
            the 4-D one.

    Example:
        >>> Attention("causal", sliding_window="sliding_window", layer_types=True).layer_types
        True
    """

    mask: Literal["causal", "bidirectional"]
    sliding_window: str | None = None
    layer_types: bool = False
    softcap: str | None = None
    qk_norm: bool = False
    sinks: bool = False
    linear: str | None = None

    def __post_init__(self) -> None:
        owner = f"Attention({self.mask!r})"
        choice(owner, "mask", self.mask, ("causal", "bidirectional"))
        optional_ident(owner, "sliding_window", self.sliding_window)
        optional_ident(owner, "softcap", self.softcap)
        optional_ident(owner, "linear", self.linear)
        for what in ("layer_types", "qk_norm", "sinks"):
            if not isinstance(getattr(self, what), bool):
                raise InputTypeError(f"{owner}: {what} must be True or False.")
        if self.linear is not None and not self.layer_types:
            raise ConfigurationError(
                f"{owner}: linear-attention layers are picked by config.layer_types; set "
                "layer_types=True."
            )
