"""The op-name contract (:mod:`opake.core.ops`): backends, patches and the testing kit agree."""

from __future__ import annotations

import importlib
import pkgutil

import torch

import opake.kernels
from opake.core import ops
from opake.core.plugins import kernel_backends
from opake.kernels import linear_cross_entropy_example_grads
from opake.kernels.testing import reference, reference_example_grads


def test_every_op_a_backend_declares_is_in_the_contract():
    backends = kernel_backends()
    assert {"torch", "chunked", "triton"} <= set(backends)
    for be in backends.values():
        assert set(be.ops) <= set(ops.ALL_OPS), be.name
    declared = set().union(*(set(be.ops) for be in backends.values()))
    assert declared == set(ops.ALL_OPS)  # and every contract op is implemented somewhere


def test_every_op_in_the_contract_has_a_torch_reference():
    torch_backend = kernel_backends()["torch"]
    for op in ops.ALL_OPS:
        ref = reference(op)
        assert callable(ref), op
        if op in torch_backend.ops:
            assert ref is torch_backend.load_op(op)
            assert ref.__module__.startswith("opake.kernels.torch."), op
    assert set(ops.MODEL_OPS) | {ops.CLIP_ACCUMULATE} <= set(torch_backend.ops)


def test_the_example_grads_reference_agrees_with_the_chunked_op(gen):
    """The reference of the implicit ops is a real oracle: it agrees with the chunked backend."""
    h = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 5), generator=gen)
    y[1, 3:] = -100
    g = torch.rand(2, 5, generator=gen, dtype=torch.float64)
    want, _ = reference_example_grads(h, w, y, g)
    got = linear_cross_entropy_example_grads(h.float(), w.float(), y, g.float(), chunk_size=4)
    torch.testing.assert_close(
        got.sq_norms()[0].double(), want.square().sum((1, 2)), rtol=1e-5, atol=1e-7
    )


def test_no_module_gives_an_op_a_second_name():
    """Op names are the contract's constants only: no module of opake.kernels binds one to a
    name of its own (an alias that a test would have to pin)."""
    for info in pkgutil.walk_packages(opake.kernels.__path__, "opake.kernels."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # the triton backend without triton installed
            assert ".triton" in info.name, info.name
            continue
        for name, value in vars(module).items():
            assert not (isinstance(value, str) and value in ops.ALL_OPS), (info.name, name)
