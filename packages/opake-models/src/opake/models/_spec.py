"""The declarative description of one Hugging Face model family (what an adapter knows).

A family module (``opake.models.llama`` …) is one :class:`FamilySpec` and a one-line ``apply``.
Everything :func:`opake.models.apply_family` does is read from the spec: where the decoder
layers are (the checkpoint boundary), which MLP and norm modules a kernel may replace, how the
attention mask must be built, and the head — its weight, whether it is tied to the embedding
and how logits are transformed. The loss-only path and the logits path are both computed from
the same :class:`LogitTransform`, so they cannot drift apart.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from opake.core.errors import ConfigurationError, InputTypeError

__all__ = [
    "MLP_KINDS",
    "NORM_KINDS",
    "NORM_PLACEMENTS",
    "ROPE_KINDS",
    "ROUTINGS",
    "TASKS",
    "Attention",
    "CausalLMHead",
    "ClassifierHead",
    "FamilySpec",
    "LogitTransform",
    "Mlp",
    "Moe",
    "Norm",
    "Rope",
]

#: MLP shapes: ``down(silu(gate) * up)``, ``down(gelu(gate) * up)``, ``fc2(gelu(fc1(x)))``
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


def _choice(owner: str, what: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigurationError(f"{owner}: {what}={value!r} is not one of {allowed}.")


def _ident(owner: str, what: str, value: object, *, path: bool = False) -> None:
    pattern = _PATH if path else _IDENT
    if not isinstance(value, str) or not pattern.match(value):
        kind = "a dotted attribute path such as 'model.layers'" if path else "an identifier"
        raise ConfigurationError(f"{owner}: {what}={value!r} is not {kind}.")


def _optional_ident(owner: str, what: str, value: object) -> None:
    if value is not None:
        _ident(owner, what, value)


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
        _choice(owner, "kind", self.kind, MLP_KINDS)
        _ident(owner, "module", self.module)
        for what in ("gate", "up", "down", "gate_up"):
            _optional_ident(owner, what, getattr(self, what))
        _ident(owner, "act", self.act)
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
        _choice(owner, "kind", self.kind, NORM_KINDS)
        _ident(owner, "module", self.module)
        _choice(owner, "placement", self.placement, NORM_PLACEMENTS)
        _ident(owner, "eps", self.eps)
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
        _choice(owner, "kind", self.kind, ROPE_KINDS)
        _optional_ident(owner, "module", self.module)
        _optional_ident(owner, "skip", self.skip)
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
        _choice(owner, "mask", self.mask, ("causal", "bidirectional"))
        _optional_ident(owner, "sliding_window", self.sliding_window)
        _optional_ident(owner, "softcap", self.softcap)
        _optional_ident(owner, "linear", self.linear)
        for what in ("layer_types", "qk_norm", "sinks"):
            if not isinstance(getattr(self, what), bool):
                raise InputTypeError(f"{owner}: {what} must be True or False.")
        if self.linear is not None and not self.layer_types:
            raise ConfigurationError(
                f"{owner}: linear-attention layers are picked by config.layer_types; set "
                "layer_types=True."
            )


@dataclass(frozen=True)
class LogitTransform:
    """The logit transform of one model instance: ``softcap(z · scale / divisor)``.

    ``softcap(z) = cap · tanh(z / cap)``. The same object feeds the logits path
    (:meth:`apply`) and the loss-only path (:meth:`kernel_kwargs`, the arguments of
    ``linear_cross_entropy``), so the two compute the same function.

    Example:
        >>> t = LogitTransform(scale=0.5, divisor=None, softcap=None)
        >>> t.kernel_kwargs()
        {'logit_scale': 0.5, 'logit_divisor': None, 'softcap': None}
        >>> LogitTransform(None, None, None).identity
        True
    """

    scale: float | None
    divisor: float | None
    softcap: float | None

    @property
    def identity(self) -> bool:
        """True when logits are the plain ``lm_head`` output."""
        return self.scale is None and self.divisor is None and self.softcap is None

    def kernel_kwargs(self) -> dict[str, float | None]:
        """The keyword arguments of ``opake.kernels.linear_cross_entropy`` for this transform."""
        return {"logit_scale": self.scale, "logit_divisor": self.divisor, "softcap": self.softcap}

    def apply(self, logits: Any) -> Any:
        """Transform ``lm_head`` outputs exactly as the kernels do (scale, divide, softcap)."""
        import torch

        out = logits
        if self.scale is not None:
            out = out * self.scale
        if self.divisor is not None:
            out = out / self.divisor
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def _config_number(config: Any, attr: str | None, what: str) -> float | None:
    if attr is None:
        return None
    value = getattr(config, attr, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"config.{attr}={value!r} ({what}) is not a number; fix the model config."
        )
    return float(value)


@dataclass(frozen=True)
class CausalLMHead:
    """A language-model head: ``logits = transform(lm_head(norm(backbone(x))))``.

    Args:
        backbone: attribute path of the decoder stack (``"model"``; ``"transformer"`` for GPT-2).
        lm_head: attribute path of the output projection.
        embedding: attribute path of the input embedding (to tell whether ``lm_head`` is tied).
        tied: whether the family ties ``lm_head`` to the embedding by default (the instance
            is checked; a tied weight gets the sum of both uses' gradients).
        logit_scale: config attribute multiplying the logits (Cohere ``logit_scale``).
        logit_divisor: config attribute dividing the logits (Granite ``logits_scaling``).
        final_softcap: config attribute of the final logit softcap (Gemma 2).

    Example:
        >>> from types import SimpleNamespace
        >>> head = CausalLMHead(logit_divisor="logits_scaling")
        >>> head.transform(SimpleNamespace(logits_scaling=4)).divisor
        4.0
    """

    backbone: str = "model"
    lm_head: str = "lm_head"
    embedding: str = "model.embed_tokens"
    tied: bool = False
    logit_scale: str | None = None
    logit_divisor: str | None = None
    final_softcap: str | None = None

    task: str = field(default="causal_lm", init=False)

    def __post_init__(self) -> None:
        owner = "CausalLMHead"
        for what in ("backbone", "lm_head", "embedding"):
            _ident(owner, what, getattr(self, what), path=True)
        for what in ("logit_scale", "logit_divisor", "final_softcap"):
            _optional_ident(owner, what, getattr(self, what))
        if not isinstance(self.tied, bool):
            raise InputTypeError(f"{owner}: tied must be True or False, got {self.tied!r}.")

    def transform(self, config: Any) -> LogitTransform:
        """Read this head's logit transform from a model config."""
        scale = _config_number(config, self.logit_scale, "logit scale")
        divisor = _config_number(config, self.logit_divisor, "logit divisor")
        softcap = _config_number(config, self.final_softcap, "final logit softcap")
        if divisor == 0.0:
            raise ConfigurationError(f"config.{self.logit_divisor}=0 would divide logits by 0.")
        if softcap is not None and softcap <= 0.0:
            softcap = None  # transformers skips a non-positive cap as well
        return LogitTransform(
            scale=None if scale == 1.0 else scale,
            divisor=None if divisor == 1.0 else divisor,
            softcap=softcap,
        )


@dataclass(frozen=True)
class ClassifierHead:
    """A sequence-classification head (BERT): pooled first token → dropout → linear.

    Args:
        backbone: attribute path of the encoder (``"bert"``).
        classifier: attribute path of the output projection.
        embedding: attribute path of the word embedding.

    Example:
        >>> ClassifierHead().task
        'sequence_classification'
    """

    backbone: str = "bert"
    classifier: str = "classifier"
    embedding: str = "bert.embeddings.word_embeddings"

    task: str = field(default="sequence_classification", init=False)

    def __post_init__(self) -> None:
        for what in ("backbone", "classifier", "embedding"):
            _ident("ClassifierHead", what, getattr(self, what), path=True)


@dataclass(frozen=True)
class Moe:
    """A sparse mixture-of-experts feed-forward block (router + fused experts).

    The adapter replaces the block's forward on each instance (see :mod:`opake.models._moe`):
    routing stays per token, the experts run densely under ``vmap`` (no data-dependent
    shapes) and batch-first under the book-keeping engine, and the router's auxiliary
    (load-balancing) loss is computed per example.

    Args:
        block: class name of the MoE block (``"MixtralSparseMoeBlock"``).
        experts: attribute of the fused experts module inside the block: one tensor per
            projection, ``[E, ...]``, as transformers' ``use_experts_implementation`` classes
            store them.
        router: attribute of the router inside the block (``"gate"``; GPT-OSS ``"router"``):
            called on the flattened tokens it returns ``(logits, top-k weights, top-k index)``.
        routing: how the router turns logits into weights (:data:`ROUTINGS`); the book-keeping
            engine recomputes the weights from tapped logits with it (``"family"``: not
            expressible, book-keeping refuses the router).
        normalize: config attribute saying whether the top-k weights are renormalised to sum
            to 1 (Qwen ``norm_topk_prob``), or ``True``/``False`` when the family fixes it.
        router_linear: attribute of an ``nn.Linear`` inside the router computing the logits
            (Hunyuan ``wg``): the adapter calls it on the batch-first hidden states and routes
            with ``routing``.
        shared: attribute of a shared expert MLP added to every token (Qwen3-Next, Hunyuan).
        shared_gate: attribute of the ``Linear(H, 1)`` whose sigmoid scales the shared expert.
        returns_scores: the block returns ``(hidden, top-k weights)`` (GPT-OSS).
        jitter: config attribute of multiplicative router input noise in training (Mixtral).
        aux_loss: the causal-LM head adds ``router_aux_loss_coef`` × the load-balancing loss
            when ``output_router_logits`` is on.
        router_input_ids: attribute of the block that, when true, makes its router pick experts
            from the token ids (DeepSeek-V4's hash routing, ``is_hash``): the block then takes
            ``input_ids`` and hands them to the router.

    Example:
        >>> Moe("MixtralSparseMoeBlock", normalize=True).routing
        'softmax_topk'
    """

    block: str
    experts: str = "experts"
    router: str = "gate"
    routing: str = "softmax_topk"
    normalize: str | bool = "norm_topk_prob"
    router_linear: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
    returns_scores: bool = False
    jitter: str | None = None
    aux_loss: bool = True
    router_input_ids: str | None = None

    def __post_init__(self) -> None:
        owner = f"Moe({self.block!r})"
        _ident(owner, "block", self.block)
        _ident(owner, "experts", self.experts)
        _ident(owner, "router", self.router)
        _choice(owner, "routing", self.routing, ROUTINGS)
        if not isinstance(self.normalize, bool):
            _ident(owner, "normalize", self.normalize)
        for what in ("router_linear", "shared", "shared_gate", "jitter", "router_input_ids"):
            _optional_ident(owner, what, getattr(self, what))
        for what in ("returns_scores", "aux_loss"):
            if not isinstance(getattr(self, what), bool):
                raise InputTypeError(f"{owner}: {what} must be True or False.")
        if self.shared_gate is not None and self.shared is None:
            raise ConfigurationError(f"{owner}: shared_gate needs the shared expert it gates.")


@dataclass(frozen=True)
class FamilySpec:
    """Everything an adapter knows about one family of Hugging Face models.

    Args:
        name: the family name registered with Opake (``"llama"``).
        model_types: the ``config.model_type`` values it covers.
        layer: class name of one decoder (or encoder) layer — the gradient-checkpoint boundary;
            the adapter finds the layers by class and checks there are
            ``config.num_hidden_layers`` of them.
        mlp: the dense (gated) MLP, see :class:`Mlp`; None for a family whose every
            feed-forward block is a mixture of experts (Mixtral).
        norm: the normalisation layers, see :class:`Norm`.
        rope: the rotary embedding, see :class:`Rope`.
        attention: the attention and its mask, see :class:`Attention`.
        head: :class:`CausalLMHead` or :class:`ClassifierHead`.
        models: class names of the task models the adapter patches (``"LlamaForCausalLM"``).
        tiny_config: config keyword arguments of a tiny model that exercises every quirk of
            the family (hidden ≤ 64, 2 layers, vocab ≤ 256): the conformance suite and the
            benchmark build models from it.
        requires: the library versions the adapter targets.
        moe: the mixture-of-experts block, see :class:`Moe` (None: a dense family).

    Example:
        >>> from opake.models import family_spec
        >>> family_spec("gpt2").head.tied
        True
    """

    name: str
    model_types: tuple[str, ...]
    layer: str
    mlp: Mlp | None
    norm: Norm
    rope: Rope
    attention: Attention
    head: CausalLMHead | ClassifierHead
    models: tuple[str, ...]
    tiny_config: Mapping[str, Any]
    requires: str = "transformers>=5.17,<6"
    moe: Moe | None = None

    def __post_init__(self) -> None:
        owner = f"FamilySpec({self.name!r})"
        if not isinstance(self.model_types, tuple) or not self.model_types:
            raise InputTypeError(f"{owner}: model_types must be a non-empty tuple of strings.")
        _ident(owner, "layer", self.layer)
        if self.mlp is None and self.moe is None:
            raise ConfigurationError(f"{owner}: give the dense MLP, the MoE block, or both.")
        if self.mlp is not None and not isinstance(self.mlp, Mlp):
            raise InputTypeError(f"{owner}: mlp must be a Mlp or None.")
        if self.moe is not None and not isinstance(self.moe, Moe):
            raise InputTypeError(f"{owner}: moe must be a Moe or None.")
        for what, kind in (
            ("norm", Norm),
            ("rope", Rope),
            ("attention", Attention),
        ):
            if not isinstance(getattr(self, what), kind):
                raise InputTypeError(f"{owner}: {what} must be a {kind.__name__}.")
        if not isinstance(self.head, (CausalLMHead, ClassifierHead)):
            raise InputTypeError(f"{owner}: head must be a CausalLMHead or a ClassifierHead.")
        if self.head.task == "sequence_classification" and self.attention.mask != "bidirectional":
            raise ConfigurationError(f"{owner}: a classifier family must use bidirectional masks.")
        if not isinstance(self.models, tuple) or not self.models:
            raise InputTypeError(f"{owner}: models must be a non-empty tuple of class names.")
        for cls in self.models:
            _ident(owner, "models[]", cls)
        if not isinstance(self.tiny_config, Mapping):
            raise InputTypeError(f"{owner}: tiny_config must be a mapping of config arguments.")
        object.__setattr__(self, "tiny_config", MappingProxyType(dict(self.tiny_config)))

    @property
    def task(self) -> str:
        """``"causal_lm"`` or ``"sequence_classification"``."""
        return self.head.task
