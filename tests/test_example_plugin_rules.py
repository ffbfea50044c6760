"""The example third-party plugin's book-keeping rule, found through its entry point, handles
its own layer and passes the generated rule conformance test like every registered rule.

The plugin is installed as its own distribution (``pip install --target``) and used in a fresh
interpreter, exactly as a third party's would be.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ROOT, run_json, run_python

PLAN = """
import json, torch
from opake.dpsgd.bookkeeping import bookkeeping_plan, registered_rules
from opake_example_plugin.layers import ScaleShift
model = torch.nn.Sequential(torch.nn.Linear(4, 4), ScaleShift(4))
plan = bookkeeping_plan(model, [name for name, _ in model.named_parameters()])
print(json.dumps({
    "rules": [rule.name for rule in registered_rules()],
    "plan": [[layer.module, layer.rule] for layer in plan.layers],
}))
"""

CONFORMANCE = Path(ROOT) / "packages" / "opake-core" / "tests" / "test_bookkeeping_conformance.py"


@pytest.mark.slow
def test_example_plugin_rule_is_registered_and_used(example_plugin_site):
    out = run_json(PLAN, path=example_plugin_site)
    assert "example-scale-shift" in out["rules"]
    assert out["rules"][-1] == "per_layer"  # the fallback stays last
    assert out["plan"] == [["0", "linear"], ["1", "example-scale-shift"]]


@pytest.mark.slow
def test_example_plugin_rule_passes_the_generated_conformance_test(example_plugin_site):
    code = (
        "import sys, pytest\n"
        f"sys.exit(pytest.main([{str(CONFORMANCE)!r}, '-q', '-p', 'no:cacheprovider', "
        "'--import-mode=importlib', '-k', 'example-scale-shift']))\n"
    )
    proc = run_python(code, path=example_plugin_site)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_example_plugin_rule_passes_the_public_harness_in_one_call(example_plugin_site):
    """What the plugin's own tests would run: the public harness, outside this repository's
    tests, on the installed rule by name and on the rule object itself."""
    code = (
        "from opake.core.testing import check_rule\n"
        "from opake.core.plugins import bookkeeping_rules\n"
        "rule = bookkeeping_rules()['example-scale-shift']\n"
        "by_name = check_rule('example-scale-shift', max_examples=4)\n"
        "print(by_name, check_rule(rule, max_examples=2))\n"
    )
    proc = run_python(code, path=example_plugin_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "1"]
