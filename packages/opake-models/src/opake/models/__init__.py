"""Opake model families: per-family adapters for Hugging Face models, found as plugins.

Each family is a small declarative module (``opake.models.llama``, ``opake.models.gpt2`` …)
holding one :class:`FamilySpec` and an ``apply(model, options)`` that
:func:`opake.patches.apply_model_patches` calls for models of that ``config.model_type``.
:func:`apply_family` turns any spec — a third party's too — into the patches.

>>> import opake.models
>>> opake.models.__version__
'0.1.0'
>>> "llama" in opake.models.family_names()
True
>>> opake.models.family_spec("granite").head.logit_divisor
'logits_scaling'
"""

from __future__ import annotations

from opake.models._apply import FamilyReport, apply_family, unwrap_model
from opake.models._registry import family_names, family_spec
from opake.models._spec import (
    MLP_KINDS,
    NORM_KINDS,
    NORM_PLACEMENTS,
    ROPE_KINDS,
    ROUTINGS,
    TASKS,
    Attention,
    CausalLMHead,
    ClassifierHead,
    FamilySpec,
    LogitTransform,
    Mlp,
    Moe,
    Norm,
    Rope,
)
from opake.models._version import __version__

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
    "FamilyReport",
    "FamilySpec",
    "LogitTransform",
    "Mlp",
    "Moe",
    "Norm",
    "Rope",
    "__version__",
    "apply_family",
    "family_names",
    "family_spec",
    "unwrap_model",
]
