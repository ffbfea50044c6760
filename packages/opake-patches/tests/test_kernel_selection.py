"""Every kernel the patches call comes from ``opake.core.plugins.select_kernel``: a third-party
backend registered through the ``opake_kernel_backends`` hook is chosen like opake-kernels' own,
and each op has one name, the contract's (:mod:`opake.core.ops`)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import opake.patches
from opake.core import ops, plugins
from opake.core.errors import ConfigurationError, OperationError
from opake.core.plugins import KernelBackend, ModelFamily, hookimpl
from opake.patches import FamilyResult, HFCompat, LossOnlyHead, apply_model_patches
from opake.patches.hf import _loss_only
from opake.patches.model import FLAG_BACKENDS, resolve_loss_kernel

pytest.importorskip("transformers")
chunked = pytest.importorskip("opake.kernels.chunked")
kernels_plugin = pytest.importorskip("opake.kernels._plugin")

CALLS: list[str] = []


def third_party_recorded(*args, **kwargs):
    """A third party's ``linear_cross_entropy_recorded`` (chunked's, counting its calls)."""
    CALLS.append(ops.LINEAR_CROSS_ENTROPY_RECORDED)
    return chunked.linear_cross_entropy_recorded(*args, **kwargs)


def third_party_lce(*args, **kwargs):
    CALLS.append(ops.LINEAR_CROSS_ENTROPY)
    return chunked.linear_cross_entropy(*args, **kwargs)


class _ThirdParty:
    """A plugin outside opake: a family for Llama and one kernel backend, ``ext``."""

    def __init__(self, backend_ops):
        self.backend_ops = backend_ops

    @hookimpl
    def opake_model_families(self):
        return [ModelFamily("toyllama", ("llama",), apply=_apply)]

    @hookimpl
    def opake_kernel_backends(self):  # above opake's triton (20) and chunked (10)
        return [KernelBackend("ext", self.backend_ops, devices=("cpu",), priority=30)]


class _Backends:
    def __init__(self, backends):
        self.backends = backends

    @hookimpl
    def opake_kernel_backends(self):
        return self.backends


def _apply(model, options):
    return FamilyResult(hf=HFCompat("causal", LossOnlyHead()))


@pytest.fixture
def third_party(fresh_plugins, monkeypatch):
    """Register opake-kernels and a third-party backend with the given ops."""
    monkeypatch.setattr(_loss_only, "_reported", set())
    CALLS.clear()

    def register(backend_ops):
        plugins.register_plugin(kernels_plugin, "opake-kernels")
        plugins.register_plugin(_ThirdParty(backend_ops), "third-party")

    return register


def _bookkeeping_grads(model, method):
    """The clipped sum of ``lm_head``'s per-example gradients (everything else frozen) through
    the loss-only forward."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))

    def losses(t, f, ids, labels):
        return fmodel((t, f), input_ids=ids, labels=labels, loss_only=True, per_example_loss=True)

    grad_fn, state = clipped_grad(
        BatchedLoss(lambda t, f, x, y: losses(t, f, x, y).loss, fmodel),
        clipping_norm=0.1,
        batch_argnums=(2, 3),
        engine=method,
    )
    grads, _ = grad_fn(trainable, frozen, ids, ids, state=state)
    return grads["lm_head.weight"]


def test_the_loss_only_path_records_through_a_third_party_backend(third_party, tiny_llama):
    """The loss backend (the torch reference here) has no recorded op: the book-keeping engine's
    recorded loss comes from the selection, which ranks the third party above ``chunked``."""
    third_party({ops.LINEAR_CROSS_ENTROPY_RECORDED: third_party_recorded})
    model = tiny_llama()
    report = apply_model_patches(model, kernels={ops.LINEAR_CROSS_ENTROPY: "torch"})
    assert report.kernels[ops.LINEAR_CROSS_ENTROPY].backend == "torch"
    got = _bookkeeping_grads(model, "bookkeeping")
    assert CALLS == [ops.LINEAR_CROSS_ENTROPY_RECORDED]
    torch.testing.assert_close(got, _bookkeeping_grads(model, "vmap"))


def test_a_third_party_loss_backend_with_the_recorded_op_runs_both(third_party, tiny_llama):
    third_party(
        {
            ops.LINEAR_CROSS_ENTROPY: third_party_lce,
            ops.LINEAR_CROSS_ENTROPY_RECORDED: third_party_recorded,
        }
    )
    model = tiny_llama()
    report = apply_model_patches(model, chunked_linear_cross_entropy=False)
    assert report.kernels[ops.LINEAR_CROSS_ENTROPY].backend == "ext"  # chunked only excluded
    _bookkeeping_grads(model, "bookkeeping")
    assert set(CALLS) == {ops.LINEAR_CROSS_ENTROPY, ops.LINEAR_CROSS_ENTROPY_RECORDED}


def test_a_forced_backend_without_the_recorded_op_raises(third_party, monkeypatch):
    third_party({ops.LINEAR_CROSS_ENTROPY: third_party_lce})
    monkeypatch.setenv(plugins.KERNEL_BACKEND_ENV, "ext")
    kernel = _loss_only.LossKernel("ext", third_party_lce)
    with pytest.raises(OperationError, match="needs 'linear_cross_entropy_recorded'"):
        _loss_only._recorded_impl(kernel, torch.device("cpu"))


@pytest.mark.parametrize("flag", sorted(FLAG_BACKENDS))
def test_a_flag_requests_its_backend_from_the_selection(fresh_plugins, tiny_llama, flag):
    """A flag set to True names its backend explicitly: not installed → raises (loudly)."""
    plugins.register_plugin(_ThirdParty({ops.LINEAR_CROSS_ENTROPY: third_party_lce}), "p")
    with pytest.raises(ConfigurationError, match=f"{FLAG_BACKENDS[flag]!r}.*not installed"):
        apply_model_patches(tiny_llama(), **{flag: True})


@pytest.mark.parametrize(
    ("fused", "chunked", "backend", "chunk_size"),
    [
        (True, None, "triton", True),
        (True, 0, "triton", True),  # 0 turns chunked off; it is no tile cap for triton
        (None, 24, "chunked", 24),
        (False, True, "chunked", True),
    ],
)
def test_each_flag_names_its_backend(fresh_plugins, fused, chunked, backend, chunk_size):
    runs_anywhere = {ops.LINEAR_CROSS_ENTROPY: third_party_lce}
    backends = [KernelBackend(name, runs_anywhere, ("cpu",)) for name in FLAG_BACKENDS.values()]
    plugins.register_plugin(_Backends(backends), "fakes")
    kernel, _ = resolve_loss_kernel(
        performance=True, kernels=None, fused=fused, chunked=chunked, device_type="cpu"
    )
    assert (kernel.backend, kernel.chunk_size) == (backend, chunk_size)


def test_patches_give_no_op_a_second_name():
    """No module of opake.patches binds an op name of the contract to a name of its own."""
    for info in pkgutil.walk_packages(opake.patches.__path__, "opake.patches."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            assert not (isinstance(value, str) and value in ops.ALL_OPS), (info.name, name)
