"""opake-models' plugin: registers its model families through the public hook.

The table below is all that plugin discovery reads: no family module (and neither torch nor
transformers) is imported until a model of that family is patched. A meta-test checks that the
table and the family modules agree.
"""

from __future__ import annotations

from opake.core.plugins import BookkeepingRule, ModelFamily, hookimpl

__all__ = ["FAMILIES", "REQUIRES", "opake_bookkeeping_rules", "opake_model_families"]

#: the transformers versions every first-party adapter targets
REQUIRES = "transformers>=5.17,<6"

#: family name (= module ``opake.models.<name>``) → the ``config.model_type`` values it handles
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama",),
    "mistral": ("mistral",),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "gemma": ("gemma",),
    "gemma2": ("gemma2",),
    "phi3": ("phi3",),
    "gpt2": ("gpt2",),
    "cohere": ("cohere",),
    "granite": ("granite",),
    "olmo2": ("olmo2",),
    "bert": ("bert",),
    "gemma3": ("gemma3_text",),
    "cohere2": ("cohere2",),
    "glm4": ("glm4",),
    "smollm3": ("smollm3",),
    "olmo3": ("olmo3",),
    "ministral": ("ministral",),
    "exaone4": ("exaone4",),
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe",),
    "mellum": ("mellum",),
    "gpt_oss": ("gpt_oss",),
    "hunyuan_v1_moe": ("hunyuan_v1_moe",),
    "qwen3_next": ("qwen3_next",),
    "deepseek_v4": ("deepseek_v4",),
}


@hookimpl
def opake_model_families() -> list[ModelFamily]:
    """One :class:`~opake.core.plugins.ModelFamily` per family module, imported lazily."""
    return [
        ModelFamily(name, model_types, apply=f"opake.models.{name}:apply", requires=REQUIRES)
        for name, model_types in FAMILIES.items()
    ]


@hookimpl
def opake_bookkeeping_rules() -> list[BookkeepingRule]:
    """Book-keeping rules for the families' own layers (their callables imported when used)."""
    from opake.models._norm_rule import RULE as FAMILY_NORM
    from opake.models.bookkeeping import ATTENTION_SINKS, BROADCAST_PARAMS, FUSED_EXPERTS

    return [FAMILY_NORM, FUSED_EXPERTS, ATTENTION_SINKS, BROADCAST_PARAMS]
