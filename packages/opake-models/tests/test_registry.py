"""Meta-tests: the plugin's family table, the family modules and transformers agree."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
import transformers

import opake.models
from opake.core import plugins
from opake.models import FamilySpec, family_names, family_spec
from opake.models._plugin import FAMILIES, REQUIRES

MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(opake.models.__path__)
    if not m.name.startswith("_") and m.name not in ("testing", "bookkeeping")
)
REQUIRED = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "gpt2",
    "cohere",
    "granite",
    "olmo2",
    "bert",
    # the families people fine-tune now (transformers 5.x)
    "gemma3",
    "cohere2",
    "glm4",
    "smollm3",
    "olmo3",
    "ministral",
    "exaone4",
    "mixtral",
    "qwen3_moe",
    "mellum",
    "gpt_oss",
    "hunyuan_v1_moe",
    "qwen3_next",
    "deepseek_v4",
}


def test_every_family_module_is_registered_and_vice_versa():
    assert sorted(FAMILIES) == MODULES
    assert set(family_names()) >= REQUIRED


def test_entry_point_registers_every_family_lazily():
    fams = plugins.model_families()
    for name, model_types in FAMILIES.items():
        for mt in model_types:
            fam = fams[mt]
            assert fam.name == name
            assert fam.apply == f"opake.models.{name}:apply"  # a dotted path: imported on use
            assert fam.requires == REQUIRES
            assert fam.supported()[0], fam.supported()[1]
    assert not [b for b in plugins.broken_plugins() if b.distribution == "opake-models"]


@pytest.mark.parametrize("name", MODULES)
def test_family_module_shape(name):
    module = importlib.import_module(f"opake.models.{name}")
    assert module.__all__ == ["SPEC", "apply"]
    spec = module.SPEC
    assert isinstance(spec, FamilySpec)
    assert family_spec(name) is spec
    assert spec.name == name
    assert spec.model_types == FAMILIES[name]
    assert spec.requires == REQUIRES
    assert list(inspect.signature(module.apply).parameters) == ["model", "options"]
    assert plugins.model_families()[spec.model_types[0]].load_apply() is module.apply


def _modeling(model_type: str):
    module = transformers.models.auto.configuration_auto.model_type_to_module_name(model_type)
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def _class_exists(modeling, name: str) -> bool:
    return hasattr(modeling, name) or isinstance(getattr(torch.nn, name, None), type)


@pytest.mark.parametrize("name", MODULES)
def test_spec_names_real_transformers_classes(name):
    spec = family_spec(name)
    for model_type in spec.model_types:
        assert model_type in transformers.CONFIG_MAPPING
        modeling = _modeling(model_type)
        classes = [spec.layer, spec.norm.module, *spec.models]
        if spec.mlp is not None:
            classes.append(spec.mlp.module)
        if spec.moe is not None:
            classes.append(spec.moe.block)
        if spec.rope.module is not None:
            classes.append(spec.rope.module)
        missing = [c for c in classes if not _class_exists(modeling, c)]
        assert not missing, f"{name}: {missing} not in {modeling.__name__}"


@pytest.mark.parametrize("name", MODULES)
def test_tiny_config_is_tiny(name):
    spec = family_spec(name)
    config = transformers.AutoConfig.for_model(spec.model_types[0], **spec.tiny_config)
    assert config.num_hidden_layers == 2
    assert config.hidden_size <= 64
    assert config.vocab_size <= 256


def test_family_spec_rejects_unknown_names():
    with pytest.raises(opake.core.errors.ConfigurationError, match="has no family 'gpt5'"):
        family_spec("gpt5")
    with pytest.raises(opake.core.errors.InputTypeError):
        family_spec(3)
