"""The mixture-of-experts block a family spec declares.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._spec_checks import ROUTINGS, choice, ident, optional_ident

__all__ = ["Moe"]


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
        ident(owner, "block", self.block)
        ident(owner, "experts", self.experts)
        ident(owner, "router", self.router)
        choice(owner, "routing", self.routing, ROUTINGS)
        if not isinstance(self.normalize, bool):
            ident(owner, "normalize", self.normalize)
        for what in ("router_linear", "shared", "shared_gate", "jitter", "router_input_ids"):
            optional_ident(owner, what, getattr(self, what))
        for what in ("returns_scores", "aux_loss"):
            if not isinstance(getattr(self, what), bool):
                raise InputTypeError(f"{owner}: {what} must be True or False.")
        if self.shared_gate is not None and self.shared is None:
            raise ConfigurationError(f"{owner}: shared_gate needs the shared expert it gates.")
