"""The plugin contract: descriptors, discovery, duplicates, broken plugins, kernel selection."""

from __future__ import annotations

import sys
import types
from importlib import metadata

import pytest

from opake.core import plugins
from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OpakePluginWarning,
    OperationError,
)
from opake.core.plugins import BookkeepingRule, KernelBackend, ModelFamily, hookimpl


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A plugin manager with no entry points; restored afterwards."""
    monkeypatch.setenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def _apply(model, options):
    return {"patched": True}


# -- descriptors -------------------------------------------------------------------------------


def test_model_family_valid_and_frozen():
    fam = ModelFamily("toy", ["toy", "toy2"], apply=_apply, requires="pluggy>=1")
    assert fam.model_types == ("toy", "toy2")
    assert fam.load_apply() is _apply
    with pytest.raises(AttributeError):
        fam.name = "other"  # type: ignore[misc]
    ok, why = fam.supported()
    assert ok, why


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "", "model_types": ("a",), "apply": _apply}, ConfigurationError),
        ({"name": "Bad Name", "model_types": ("a",), "apply": _apply}, ConfigurationError),
        ({"name": 3, "model_types": ("a",), "apply": _apply}, InputTypeError),
        ({"name": "x", "model_types": "llama", "apply": _apply}, InputTypeError),
        ({"name": "x", "model_types": (), "apply": _apply}, ConfigurationError),
        ({"name": "x", "model_types": ("",), "apply": _apply}, ConfigurationError),
        ({"name": "x", "model_types": ("Llama",), "apply": _apply}, ConfigurationError),
        ({"name": "x", "model_types": ("a", "a"), "apply": _apply}, ConfigurationError),
        ({"name": "x", "model_types": ("a",), "apply": 42}, InputTypeError),
        ({"name": "x", "model_types": ("a",), "apply": "not a path!"}, ConfigurationError),
        (
            {"name": "x", "model_types": ("a",), "apply": _apply, "requires": "??"},
            ConfigurationError,
        ),
    ],
)
def test_model_family_rejects(kwargs, error):
    with pytest.raises(error):
        ModelFamily(**kwargs)


def test_model_family_requires_out_of_range_is_reported_not_raised():
    fam = ModelFamily("x", ("x",), apply=_apply, requires="pluggy<0.1")
    ok, why = fam.supported()
    assert not ok
    assert "outside" in why
    missing = ModelFamily("y", ("y",), apply=_apply, requires="surely-not-installed-dist>=1")
    assert missing.supported()[0] is False


def test_dotted_apply_resolves_lazily():
    fam = ModelFamily("x", ("x",), apply="opake.core.errors:OpakeError")
    assert fam.load_apply().__name__ == "OpakeError"
    broken = ModelFamily("y", ("y",), apply="opake.core.no_such_module:f")
    with pytest.raises(ConfigurationError, match="cannot import"):
        broken.load_apply()
    not_callable = ModelFamily("z", ("z",), apply="opake.core.plugins:ENTRY_POINT_GROUP")
    with pytest.raises(ConfigurationError, match="not callable"):
        not_callable.load_apply()


def test_kernel_backend_validation():
    be = KernelBackend("b", {"op": _apply}, devices=["cpu"], priority=3)
    assert be.devices == ("cpu",)
    with pytest.raises(TypeError):
        be.ops["new"] = _apply  # type: ignore[index]
    with pytest.raises(ConfigurationError):
        KernelBackend("b", {}, devices=("cpu",))
    with pytest.raises(InputTypeError):
        KernelBackend("b", [("op", _apply)], devices=("cpu",))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        KernelBackend("b", {"op": _apply}, devices=("tpu",))
    with pytest.raises(InputTypeError):
        KernelBackend("b", {"op": _apply}, devices="cpu")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        KernelBackend("b", {"op": _apply}, devices=("cpu",), priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        KernelBackend("b", {"op": _apply}, devices=("cpu",), available=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="has no op"):
        be.load_op("missing")


def test_available_that_raises_is_unavailable():
    def boom() -> bool:
        raise RuntimeError("no driver")

    assert not KernelBackend("b", {"op": _apply}, devices=("cpu",), available=boom).is_available()


# -- manager -----------------------------------------------------------------------------------


class _Families:
    def __init__(self, *fams):
        self.fams = fams

    @hookimpl
    def opake_model_families(self):
        return list(self.fams)


class _Backends:
    def __init__(self, *bes):
        self.bes = bes

    @hookimpl
    def opake_kernel_backends(self):
        return list(self.bes)


class _Rules:
    def __init__(self, *rules):
        self.rules = rules

    @hookimpl
    def opake_bookkeeping_rules(self):
        return list(self.rules)


def test_autoload_disabled_means_no_entry_points(fresh_plugins):
    assert plugins.plugins() == []
    assert plugins.model_families() == {}
    assert plugins.kernel_backends() == {}


def test_register_and_query(fresh_plugins):
    plugins.register_plugin(_Families(ModelFamily("toy", ("toy", "toy2"), apply=_apply)), "a")
    fams = plugins.model_families()
    assert set(fams) == {"toy", "toy2"}
    assert fams["toy"] is fams["toy2"]
    assert [p.name for p in plugins.plugins()] == ["a"]


def test_duplicate_family_name_raises(fresh_plugins):
    plugins.register_plugin(_Families(ModelFamily("toy", ("a",), apply=_apply)), "p1")
    plugins.register_plugin(_Families(ModelFamily("toy", ("b",), apply=_apply)), "p2")
    with pytest.raises(ConfigurationError, match="registered twice"):
        plugins.model_families()


def test_duplicate_model_type_raises(fresh_plugins):
    plugins.register_plugin(_Families(ModelFamily("one", ("llama",), apply=_apply)), "p1")
    plugins.register_plugin(_Families(ModelFamily("two", ("llama",), apply=_apply)), "p2")
    with pytest.raises(ConfigurationError, match="'llama' is claimed"):
        plugins.model_families()


def test_duplicate_backend_raises(fresh_plugins):
    plugins.register_plugin(_Backends(KernelBackend("b", {"op": _apply}, ("cpu",))), "p1")
    plugins.register_plugin(_Backends(KernelBackend("b", {"op": _apply}, ("cpu",))), "p2")
    with pytest.raises(ConfigurationError, match="registered twice"):
        plugins.kernel_backends()


def test_duplicate_plugin_name_raises(fresh_plugins):
    plugins.register_plugin(_Backends(), "same")
    with pytest.raises(ConfigurationError):
        plugins.register_plugin(_Backends(), "same")


def test_hook_returning_wrong_type_raises(fresh_plugins):
    plugins.register_plugin(_Families("not a family"), "bad")
    with pytest.raises(InputTypeError, match="expected ModelFamily"):
        plugins.model_families()


def _fake_entry_points(monkeypatch, eps):
    real = metadata.entry_points

    def fake(**kw):
        if kw.get("group") == "opake":
            return eps
        return real(**kw)

    monkeypatch.setattr(metadata, "entry_points", fake)


def test_broken_plugin_is_skipped_with_warning(monkeypatch):
    monkeypatch.delenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    good = types.ModuleType("opake_test_good_plugin")
    good.opake_kernel_backends = hookimpl(  # type: ignore[attr-defined]
        lambda: [KernelBackend("goodbe", {"op": _apply}, ("cpu",))]
    )
    monkeypatch.setitem(sys.modules, "opake_test_good_plugin", good)
    eps = [
        metadata.EntryPoint("broken", "opake_test_no_such_module", "opake"),
        metadata.EntryPoint("good", "opake_test_good_plugin", "opake"),
    ]
    _fake_entry_points(monkeypatch, eps)
    plugins.reset_plugins()
    try:
        with pytest.warns(OpakePluginWarning, match="failed to load"):
            pm = plugins.plugin_manager()
        assert pm.has_plugin("good")
        assert [b.name for b in plugins.broken_plugins()] == ["broken"]
        assert "ModuleNotFoundError" in plugins.broken_plugins()[0].error
        assert "goodbe" in plugins.kernel_backends()
    finally:
        plugins.reset_plugins()


def test_two_entry_points_with_same_name_raise(monkeypatch):
    monkeypatch.delenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    eps = [
        metadata.EntryPoint("dup", "opake.core.errors", "opake"),
        metadata.EntryPoint("dup", "opake.core._dotted", "opake"),
    ]
    _fake_entry_points(monkeypatch, eps)
    plugins.reset_plugins()
    try:
        with pytest.raises(ConfigurationError, match="two plugins claim"):
            plugins.plugin_manager()
    finally:
        plugins.reset_plugins()


# -- kernel selection --------------------------------------------------------------------------


def _impl_a(*a):
    return "a"


def _impl_b(*a):
    return "b"


@pytest.fixture
def three_backends(fresh_plugins):
    plugins.register_plugin(
        _Backends(
            KernelBackend("torch", {"op": _impl_a, "other": _impl_a}, ("cpu", "cuda")),
            KernelBackend("fast", {"op": _impl_b}, ("cpu",), priority=10),
            KernelBackend("gpu", {"op": _impl_b}, ("cuda",), priority=20, available=lambda: False),
        ),
        "bes",
    )


def test_select_automatic_prefers_priority(three_backends):
    choice = plugins.select_kernel("op", "cpu")
    assert choice.backend == "fast"
    assert choice.reason.startswith("automatic")
    assert plugins.select_kernel("other", "cpu").backend == "torch"
    # unavailable high-priority backend is skipped quietly on cuda
    assert plugins.select_kernel("op", "cuda:0").backend == "torch"


def test_select_explicit_and_env(three_backends, monkeypatch):
    assert plugins.select_kernel("op", "cpu", backend="torch").backend == "torch"
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "torch")
    choice = plugins.select_kernel("op", "cpu")
    assert choice.backend == "torch"
    assert "OPAKE_KERNEL_BACKEND" in choice.reason
    # explicit argument beats the environment
    assert plugins.select_kernel("op", "cpu", backend="fast").backend == "fast"


def test_select_explicit_that_cannot_run_raises(three_backends):
    with pytest.raises(OperationError, match="not available"):
        plugins.select_kernel("op", "cuda", backend="gpu")
    with pytest.raises(OperationError, match="runs on"):
        plugins.select_kernel("op", "cuda", backend="fast")
    with pytest.raises(OperationError, match="has no op"):
        plugins.select_kernel("other", "cpu", backend="fast")
    with pytest.raises(ConfigurationError, match="not installed"):
        plugins.select_kernel("op", "cpu", backend="nope")
    with pytest.raises(ConfigurationError, match="unknown device"):
        plugins.select_kernel("op", "tpu")


def test_select_with_nothing_installed_raises(fresh_plugins):
    with pytest.raises(OperationError, match="no installed kernel backend"):
        plugins.select_kernel("op", "cpu")


def test_device_type_of_tensor_and_device():
    torch = pytest.importorskip("torch")
    assert plugins.device_type_of(torch.zeros(1)) == "cpu"
    assert plugins.device_type_of(torch.device("cpu")) == "cpu"
    with pytest.raises(InputTypeError):
        plugins.device_type_of(3.5)


def test_import_opake_core_does_not_import_torch():
    import subprocess

    code = (
        "import sys, opake.core, opake.core.plugins as p; p.plugin_manager(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- pluggy contract: validation, blocking, argument matching, documentation --------------------


class _Typo:
    @hookimpl
    def opake_model_familys(self):  # a misspelt hook name
        return []


class _ExtraArgument:
    @hookimpl
    def opake_kernel_backends(self, device):  # the spec has no such argument
        return []


class _NewerOptional:
    @hookimpl(optionalhook=True)
    def opake_hook_of_a_newer_opake(self):
        return []

    @hookimpl
    def opake_model_families(self):
        return [ModelFamily("newer", ("newer",), apply=_apply)]


def test_register_rejects_unknown_hook_and_registers_nothing(fresh_plugins):
    with pytest.raises(ConfigurationError, match="opake_model_familys"):
        plugins.register_plugin(_Typo(), "typo")
    assert not plugins.plugin_manager().has_plugin("typo")
    assert plugins.plugins() == []


def test_register_rejects_argument_the_spec_lacks(fresh_plugins):
    with pytest.raises(ConfigurationError, match="device"):
        plugins.register_plugin(_ExtraArgument(), "extra")
    assert not plugins.plugin_manager().has_plugin("extra")


def test_optional_hook_of_newer_version_loads(fresh_plugins):
    plugins.register_plugin(_NewerOptional(), "newer")
    assert set(plugins.model_families()) == {"newer"}


def test_entry_point_failing_validation_is_skipped_with_warning(monkeypatch):
    monkeypatch.delenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    typo = types.ModuleType("opake_test_typo_plugin")

    def opake_kernel_backend():  # a misspelt hook name
        return []

    typo.opake_kernel_backend = hookimpl(opake_kernel_backend)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "opake_test_typo_plugin", typo)
    _fake_entry_points(
        monkeypatch, [metadata.EntryPoint("typo", "opake_test_typo_plugin", "opake")]
    )
    plugins.reset_plugins()
    try:
        with pytest.warns(OpakePluginWarning, match="failed to load"):
            pm = plugins.plugin_manager()
        assert not pm.has_plugin("typo")
        (broken,) = plugins.broken_plugins()
        assert broken.name == "typo"
        assert "opake_kernel_backend" in broken.error
    finally:
        plugins.reset_plugins()


def test_block_plugins_env_skips_named_entry_points(monkeypatch):
    monkeypatch.delenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("OPAKE_BLOCK_PLUGINS", " bad , other")
    good = types.ModuleType("opake_test_good2_plugin")
    good.opake_kernel_backends = hookimpl(  # type: ignore[attr-defined]
        lambda: [KernelBackend("good2", {"op": _apply}, ("cpu",))]
    )
    monkeypatch.setitem(sys.modules, "opake_test_good2_plugin", good)
    eps = [
        metadata.EntryPoint("bad", "opake_test_no_such_module", "opake"),
        metadata.EntryPoint("good", "opake_test_good2_plugin", "opake"),
    ]
    _fake_entry_points(monkeypatch, eps)
    plugins.reset_plugins()
    try:
        pm = plugins.plugin_manager()  # the blocked, broken module is never imported
        assert plugins.broken_plugins() == []
        assert plugins.blocked_plugins() == ["bad", "other"]
        assert pm.is_blocked("bad")
        assert [p.name for p in plugins.plugins()] == ["good"]
        with pytest.raises(ConfigurationError, match="blocked"):
            plugins.register_plugin(_Backends(), "bad")
    finally:
        plugins.reset_plugins()


def _hook_specs() -> dict[str, object]:
    from opake.core.plugins import hookspecs

    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, "opake_spec")
    }


#: each hook -> (the query that calls it, a plugin object implementing it, what to expect)
def _exercise() -> dict[str, tuple[object, object, object]]:
    fam = ModelFamily("ex", ("ex",), apply=_apply)
    be = KernelBackend("exbe", {"op": _apply}, ("cpu",))
    rule = BookkeepingRule("exrule", _apply, _apply, {"weight": "dense"}, _apply)
    return {
        "opake_model_families": (plugins.model_families, _Families(fam), {"ex": fam}),
        "opake_kernel_backends": (plugins.kernel_backends, _Backends(be), {"exbe": be}),
        "opake_bookkeeping_rules": (plugins.bookkeeping_rules, _Rules(rule), {"exrule": rule}),
    }


def test_every_hookspec_is_documented_and_exercised(fresh_plugins):
    import inspect
    from pathlib import Path

    specs = _hook_specs()
    assert specs, "no hookspecs found"
    guide = (Path(__file__).parents[3] / "docs" / "guide" / "plugins.md").read_text()
    exercise = _exercise()
    assert set(exercise) == set(specs), "a hookspec without a query test (add it to _exercise)"
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert "Returns:" in doc, f"{name}: document what it returns"
        assert "Since:" in doc, f"{name}: document since which version it exists"
        sig = inspect.signature(fn)
        ret = str(sig.return_annotation).replace("'", "")
        assert f"`{name}{str(sig).split(' ->')[0]} -> {ret}`" in guide, f"{name} not in the guide"
    for i, (query, plugin, expected) in enumerate(exercise.values()):
        plugins.register_plugin(plugin, f"exercise{i}")
        assert query() == expected


def test_automatic_kernel_choice_is_logged_once(three_backends, caplog):
    import logging

    from opake.core.plugins import _select

    _select._reported.clear()
    with caplog.at_level(logging.INFO, logger="opake.core"):
        first = plugins.select_kernel("op")
        plugins.select_kernel("op")
    lines = [r.getMessage() for r in caplog.records if r.name == "opake.core"]
    assert len(lines) == 1
    assert repr(first.backend) in lines[0]
    assert "automatic" in lines[0]
