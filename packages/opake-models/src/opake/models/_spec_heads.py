"""The heads a family spec declares: the causal LM head (and its logit transform), the classifier.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._spec_checks import ident, optional_ident

if TYPE_CHECKING:
    import torch

__all__ = ["CausalLMHead", "ClassifierHead", "LogitTransform"]


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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
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
            ident(owner, what, getattr(self, what), path=True)
        for what in ("logit_scale", "logit_divisor", "final_softcap"):
            optional_ident(owner, what, getattr(self, what))
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
            ident("ClassifierHead", what, getattr(self, what), path=True)
