"""Kernel swaps: instance-only, exact, reversible, all-or-nothing, and counted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import opake.kernels.torch as reference_ops
from opake.core import plugins
from opake.core.errors import ConfigurationError, OperationError
from opake.core.plugins import KernelBackend, hookimpl
from opake.models import apply_family, family_names, family_spec
from opake.models._swaps import identify_activation, modules_of_class
from opake.models.testing import tiny_model
from opake.patches import PatchOptions, apply_model_patches

OPS = ("rms_norm", "swiglu", "geglu", "linear_cross_entropy")


class CountingBackend:
    """A plugin backend that runs the torch reference ops and counts the calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _wrap(self, op):
        ref = getattr(reference_ops, op)

        def counted(*args, **kwargs):
            self.calls[op] += 1
            return ref(*args, **kwargs)

        return counted

    @hookimpl
    def opake_kernel_backends(self):
        ops = {op: self._wrap(op) for op in OPS}
        return [KernelBackend("counting", ops, devices=("cpu",), priority=-5)]


@pytest.fixture
def counting():
    backend = CountingBackend()
    plugins.register_plugin(backend, name="counting-test")
    return backend


def _ids(batch=2, seq=9, seed=0):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _out(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _instance_forwards(model):
    """Submodules (not the model itself) whose forward is an instance attribute."""
    return [name for name, m in model.named_modules() if name and "forward" in m.__dict__]


@pytest.mark.parametrize("family", family_names())
def test_swaps_are_exact_counted_and_reversible(family, counting):
    spec = family_spec(family)
    model = tiny_model(family)
    ids = _ids()
    stock = _out(model, ids)
    report = apply_family(spec, model, PatchOptions(kernels="counting"))
    n_rms = len(list(modules_of_class(model, spec.norm.module))) if spec.norm.kind == "rms" else 0
    mlp = spec.mlp
    n_mlp = len(list(modules_of_class(model, mlp.module))) if mlp and mlp.gated else 0
    patched = _out(model, ids)
    torch.testing.assert_close(patched, stock, rtol=1e-5, atol=1e-6)
    gated = "geglu" if mlp and mlp.kind == "geglu" else "swiglu"
    assert counting.calls["rms_norm"] == n_rms
    assert counting.calls[gated] == n_mlp
    assert (n_rms > 0) == ("rms_norm" in report.kernels)
    assert (n_mlp > 0) == (gated in report.kernels)
    for op, (backend, reason) in report.kernels.items():
        assert backend == "counting", op
        assert "explicit" in reason
    assert report.hf.attention == spec.attention.mask
    assert (report.hf.head is not None) == (spec.task == "causal_lm")
    report.undo()
    assert _instance_forwards(model) == []
    assert "forward" not in vars(model)
    assert not report.active
    counting.calls.clear()
    assert torch.equal(_out(model, ids), stock)
    assert sum(counting.calls.values()) == 0
    report.undo()  # idempotent


def test_only_the_given_instance_is_patched(counting):
    patched, other = tiny_model("llama"), tiny_model("llama")
    apply_family(family_spec("llama"), patched, PatchOptions(kernels="counting"))
    _out(other, _ids())
    assert sum(counting.calls.values()) == 0
    assert _instance_forwards(other) == []
    _out(patched, _ids())
    assert counting.calls["swiglu"] == 2


def test_applying_twice_returns_the_first_report(counting):
    model = tiny_model("gemma")
    first = apply_family(family_spec("gemma"), model, PatchOptions(kernels="counting"))
    assert apply_family(family_spec("gemma"), model, PatchOptions(kernels="torch")) is first
    _out(model, _ids())
    assert counting.calls["geglu"] == 2  # not wrapped twice, still the first backend
    first.undo()
    again = apply_family(family_spec("gemma"), model, PatchOptions(kernels="torch"))
    assert again is not first
    assert again.kernels["geglu"][0] == "torch"


def test_activation_that_does_not_match_the_mlp_kind_is_left_alone(counting):
    model = tiny_model("llama", hidden_act="gelu")
    stock = _out(model, _ids())
    report = apply_family(family_spec("llama"), model, PatchOptions(kernels="counting"))
    assert "swiglu" not in report.kernels
    assert "not the activation" in report.skipped["mlp"]
    torch.testing.assert_close(_out(model, _ids()), stock)
    assert counting.calls["swiglu"] == 0
    assert counting.calls["rms_norm"] == 5


def test_kernels_option_turns_ops_off(counting):
    model = tiny_model("llama")
    report = apply_family(family_spec("llama"), model, PatchOptions(kernels=False))
    assert report.kernels == {}
    assert _instance_forwards(model) == []
    report.undo()
    report = apply_family(family_spec("llama"), model, PatchOptions(kernels={"swiglu": False}))
    assert set(report.kernels) == {"rms_norm"}
    assert report.kernels["rms_norm"][0] == "chunked"  # automatic selection on CPU
    report.undo()
    report = apply_family(family_spec("llama"), model, PatchOptions(performance=False))
    assert report.skipped["kernels"] == "performance=False"
    assert report.kernels == {}


def test_explicit_backend_that_cannot_run_fails_at_patch_time_and_leaves_nothing():
    model = tiny_model("llama")
    with pytest.raises(ConfigurationError, match=r"'nope'.*not installed"):
        apply_family(family_spec("llama"), model, PatchOptions(kernels={"swiglu": "nope"}))
    assert _instance_forwards(model) == []  # the norms swapped first were restored
    assert "_opake_family_report" not in model.__dict__


@pytest.fixture
def swiglu_only_backend():
    class OnlySwiglu:
        @hookimpl
        def opake_kernel_backends(self):
            ops = {"swiglu": reference_ops.swiglu}
            return [KernelBackend("example-missing-op", ops, devices=("cpu",), priority=-5)]

    plugins.register_plugin(OnlySwiglu(), name="only-swiglu")


@pytest.mark.usefixtures("swiglu_only_backend")
def test_backend_without_the_op_raises_operation_error():
    model = tiny_model("llama")
    with pytest.raises(OperationError, match="has no op 'rms_norm'"):
        apply_family(family_spec("llama"), model, PatchOptions(kernels="example-missing-op"))
    assert _instance_forwards(model) == []


def test_structure_mismatch_fails_closed():
    from dataclasses import replace

    model = tiny_model("llama")
    with pytest.raises(ConfigurationError, match="handles model types"):
        apply_family(family_spec("gpt2"), model)
    renamed = replace(family_spec("llama"), layer="LlamaBlock")
    with pytest.raises(ConfigurationError, match=r"layers of class LlamaBlock.*transformers"):
        apply_family(renamed, model)
    assert _instance_forwards(model) == []


def test_peft_wrapped_model_is_patched_inside(counting):
    from opake.core.testing import with_lora

    model = with_lora(tiny_model("qwen3"))
    report = apply_family(family_spec("qwen3"), model, PatchOptions(kernels="counting"))
    assert report.model_type == "qwen3"
    model(input_ids=_ids())
    assert counting.calls["rms_norm"] == 9
    assert counting.calls["swiglu"] == 2


@pytest.mark.parametrize(
    ("act", "expected"),
    [
        (torch.nn.SiLU(), "silu"),
        (torch.nn.GELU(), "gelu"),
        (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
        (torch.nn.Tanh(), None),
        (lambda x: x[:1], None),
        (lambda x: 1 / 0, None),
    ],
)
def test_identify_activation(act, expected):
    assert identify_activation(act) == expected


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3", "qwen3"])
def test_per_example_grads_through_swapped_modules_match_the_loop(family):
    from opake.core.testing import per_example_grads_loop
    from opake.functional import make_functional

    model = tiny_model(family)
    ids = _ids(batch=3, seq=6, seed=2)
    fmodel, params = make_functional(model)

    def loss_fn(p, x):
        return fmodel(p, input_ids=x[None], labels=x[None], use_cache=False).loss

    expected, _ = per_example_grads_loop(loss_fn, (params, ids))
    apply_family(family_spec(family), model, PatchOptions(kernels="chunked"))
    got = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0))(params, ids)
    for i, ref in enumerate(expected):
        for k, v in ref.items():
            torch.testing.assert_close(got[k][i], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2", "cohere", "granite", "gpt2"])
def test_dispatcher_runs_the_family_and_the_loss_only_head(family, counting):
    spec = family_spec(family)
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        stock_logits = model(input_ids=ids).logits
        stock_loss = model(input_ids=ids[:1], labels=ids[:1]).loss
    report = apply_model_patches(model, kernels="counting")
    assert report.family == family
    assert report.kernels["linear_cross_entropy"].backend == "counting"
    with torch.no_grad():
        out = model(input_ids=ids[:1], labels=ids[:1], loss_only=True)
        logits = model(input_ids=ids).logits
    assert out.logits is None
    assert counting.calls["linear_cross_entropy"] == 1
    torch.testing.assert_close(out.loss, stock_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, stock_logits, rtol=1e-5, atol=1e-6)
    family_report = vars(model)["_opake_family_report"]
    assert family_report.transform == spec.head.transform(model.config)
    report.remove()
    assert "_opake_family_report" not in vars(model)
    assert _instance_forwards(model) == []
    assert "forward" not in vars(model)
