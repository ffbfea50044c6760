"""A third-party plugin installed as its own distribution is discovered through entry points."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import run_json, run_python

QUERY = """
import json, warnings
from opake.core import plugins
fams = plugins.model_families()
bes = plugins.kernel_backends()
print(json.dumps({
    "families": {mt: f.name for mt, f in fams.items()},
    "backends": sorted(bes),
    "plugins": [[p.name, p.distribution, p.version] for p in plugins.plugins()],
    "broken": [b.name for b in plugins.broken_plugins()],
}))
"""


def test_example_plugin_is_discovered(example_plugin_site):
    out = run_json(QUERY, path=example_plugin_site)
    assert out["families"]["opake_example_toy"] == "example-toy"
    assert "example" in out["backends"]
    assert "torch" in out["backends"]  # first-party backends register the same way
    assert ["example", "opake-example-plugin", "0.3.1"] in out["plugins"]
    assert ["kernels", "opake-kernels", "0.1.0"] in out["plugins"]
    assert out["broken"] == []


def test_disable_autoload_hides_every_entry_point(example_plugin_site):
    out = run_json(QUERY, path=example_plugin_site, env={"OPAKE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out == {"families": {}, "backends": [], "plugins": [], "broken": []}


def test_plugin_family_apply_and_backend_selection(example_plugin_site):
    code = """
import json, torch
from opake.core import plugins
fam = plugins.model_families()["opake_example_toy"]
class M: pass
m = M()
report = fam.load_apply()(m, None)
auto = plugins.select_kernel("rms_norm", "cpu")
explicit = plugins.select_kernel("rms_norm", "cpu", backend="example")
x, w = torch.randn(3, 8), torch.randn(8)
same = torch.allclose(explicit.impl(x, w), auto.impl(x, w), atol=1e-6)
print(json.dumps({"patched": m.opake_example_patched, "report": report,
                  "auto": auto.backend, "explicit": explicit.backend, "same": same}))
"""
    out = run_json(code, path=example_plugin_site)
    assert out["patched"] is True
    assert out["report"]["family"] == "example-toy"
    assert out["auto"] != "example"  # priority -1 never wins automatic selection
    assert out["explicit"] == "example"
    assert out["same"] is True


def test_env_var_forces_backend(example_plugin_site):
    code = (
        "import json; from opake.core import plugins; "
        "c = plugins.select_kernel('rms_norm', 'cpu'); print(json.dumps([c.backend, c.reason]))"
    )
    backend, reason = run_json(
        code, path=example_plugin_site, env={"OPAKE_KERNEL_BACKEND": "example"}
    )
    assert backend == "example"
    assert "OPAKE_KERNEL_BACKEND" in reason
    proc = run_python(
        code.replace("'rms_norm'", "'cross_entropy'"),
        path=example_plugin_site,
        env={"OPAKE_KERNEL_BACKEND": "example"},
    )
    assert proc.returncode != 0
    assert "OperationError" in proc.stderr
    assert "has no op 'cross_entropy'" in proc.stderr


def _write_fake_dist(site, name, entry_value):
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[opake]\n{name} = {entry_value}\n")


def test_broken_plugin_skipped_and_reported(example_plugin_site, tmp_path):
    _write_fake_dist(tmp_path, "opake-broken-thing", "opake_broken_thing_missing.plugin")
    code = QUERY.replace(
        "import json, warnings", "import json, warnings\nwarnings.simplefilter('error')"
    )
    proc = run_python(code, path=tmp_path)
    assert proc.returncode != 0
    assert "OpakePluginWarning" in proc.stderr
    out = run_json(QUERY, path=tmp_path)
    assert out["broken"] == ["opake-broken-thing"]
    assert "torch" in out["backends"]  # the rest still works


def test_conflicting_third_party_backend_raises(tmp_path):
    pkg = tmp_path / "opake_clash_plugin.py"
    pkg.write_text(
        "from opake.core.plugins import KernelBackend, hookimpl\n"
        "@hookimpl\n"
        "def opake_kernel_backends():\n"
        "    return [KernelBackend('torch', {'rms_norm': 'math:hypot'}, ('cpu',))]\n"
    )
    _write_fake_dist(tmp_path, "opake-clash", "opake_clash_plugin")
    proc = run_python("from opake.core import plugins; plugins.kernel_backends()", path=tmp_path)
    assert proc.returncode != 0
    assert "ConfigurationError" in proc.stderr
    assert "'torch' is registered twice" in proc.stderr


def test_opake_info_reports_everything(example_plugin_site, tmp_path):
    _write_fake_dist(tmp_path, "opake-broken-thing", "opake_broken_thing_missing.plugin")
    path = f"{example_plugin_site}:{tmp_path}"
    proc = run_python("from opake.cli import main; raise SystemExit(main(['info']))", path=path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in (
        "opake-core",
        "opake-kernels",
        "torch",
        "transformers",
        "opake-example-plugin 0.3.1",
        "opake_example_toy",
        "example",
        "Broken plugins",
        "opake_broken_thing_missing",
        "cpu",
    ):
        assert needle in text, needle
    proc = run_python(
        "from opake.cli import main; raise SystemExit(main(['info', '--json']))", path=path
    )
    info = json.loads(proc.stdout)
    assert info["libraries"]["torch"].startswith("2.")
    assert {p["name"] for p in info["plugins"]} >= {"kernels", "models", "example"}
    assert info["broken_plugins"][0]["distribution"] == "opake-broken-thing"
    assert info["kernel_backends"]["torch"]["available"] is True
    assert info["model_families"]["opake_example_toy"]["supported"] is True


@pytest.mark.parametrize("disabled", ["1", "true"])
def test_opake_info_with_autoload_disabled(disabled):
    proc = run_python(
        "from opake.cli import main; raise SystemExit(main(['info']))",
        env={"OPAKE_DISABLE_PLUGIN_AUTOLOAD": disabled},
    )
    assert proc.returncode == 0
    assert "autoload disabled" in proc.stdout


def test_console_script_is_installed():
    from importlib import metadata

    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("opake") == "opake.cli.__main__:main"
    assert sys.executable
