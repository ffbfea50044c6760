"""The example third-party plugin's real family (OLMo) passes opake-models' conformance suite.

The plugin is installed as its own distribution (``pip install --target``) and found through
its ``opake`` entry point in a fresh interpreter, exactly as a third party's would be.
"""

from __future__ import annotations

import pytest

from .conftest import run_json, run_python

CONFORMANCE = """
import json, torch
torch.set_num_threads(1)
from opake.models.testing import run_family_conformance, tiny_model
from opake.patches import apply_model_patches
from opake_example_plugin.olmo import SPEC

results = run_family_conformance(lambda: tiny_model(SPEC))
report = apply_model_patches(tiny_model(SPEC))
print(json.dumps({
    "results": results,
    "family": report.family,
    "applied": list(report.applied),
    "skipped": dict(report.skipped),
}))
"""


@pytest.mark.slow
def test_example_plugin_family_passes_the_conformance_suite(example_plugin_site):
    out = run_json(CONFORMANCE, path=example_plugin_site)
    assert out["results"]
    assert set(out["results"].values()) == {"ok"}
    assert "per_example_grads" in out["results"]
    assert out["family"] == "example-olmo"
    assert any(line.startswith("swiglu: 2 OlmoMLP") for line in out["applied"])
    assert "OlmoLayerNorm is a LayerNorm" in out["skipped"]["rms_norm"]


@pytest.mark.slow
def test_without_the_plugin_olmo_is_unsupported():
    code = CONFORMANCE.replace(
        "from opake_example_plugin.olmo import SPEC",
        "from opake.models import FamilySpec\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('opake_example_plugin') is None",
    ).split("results =")[0] + (
        "from opake.models.testing import ConformanceCase, run_check\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('olmo', vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=4)\n"
        "run_check('registered', ConformanceCase(lambda: AutoModelForCausalLM.from_config(cfg)))\n"
    )
    proc = run_python(code)
    assert proc.returncode != 0
    assert "ConformanceError" in proc.stderr
    assert "no installed model family claims model_type 'olmo'" in proc.stderr
