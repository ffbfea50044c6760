"""Bad arguments raise typed errors that say what was given and what was expected — on every
backend, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError
from opake.kernels import (
    cross_entropy,
    geglu,
    linear_cross_entropy,
    rms_norm,
    rope,
    swiglu,
)

BACKENDS = ["torch", "chunked", "triton"]


@pytest.fixture
def lce_args():
    return torch.randn(2, 3, 8), torch.randn(10, 8), torch.randint(0, 10, (2, 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reduction": "avg"}, ConfigurationError, "reduction='avg'"),
        ({"softcap": 0.0}, ConfigurationError, "softcap=0.0"),
        ({"softcap": -3}, ConfigurationError, "positive"),
        ({"logit_divisor": 0}, ConfigurationError, "divide the logits by zero"),
        ({"logit_scale": 0.0}, ConfigurationError, "logit_scale=0"),
        ({"logit_scale": "2"}, InputTypeError, "logit_scale must be a real number"),
        ({"label_smoothing": 1.5}, ConfigurationError, "label_smoothing=1.5"),
        ({"label_smoothing": float("nan")}, ConfigurationError, "finite"),
        ({"ignore_index": 1.0}, InputTypeError, "ignore_index must be an int"),
        ({"ignore_index": True}, InputTypeError, "ignore_index must be an int"),
        ({"chunk_size": -1}, ConfigurationError, "chunk_size=-1"),
        ({"chunk_size": 2.5}, InputTypeError, "chunk_size must be True"),
    ],
)
def test_bad_options_raise(backend, kwargs, error, match, lce_args):
    with pytest.raises(error, match=match):
        linear_cross_entropy(*lce_args, backend=backend, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_tensors_raise(backend, lce_args):
    h, w, y = lce_args
    with pytest.raises(ConfigurationError, match=r"expected weight of shape \(vocab, 8\)"):
        linear_cross_entropy(h, torch.randn(10, 7), y, backend=backend)
    with pytest.raises(ConfigurationError, match="must be 2-D"):
        linear_cross_entropy(h, torch.randn(10), y, backend=backend)
    with pytest.raises(InputTypeError, match="cast them to one dtype"):
        linear_cross_entropy(h, w.double(), y, backend=backend)
    with pytest.raises(InputTypeError, match="integer tensor of class indices"):
        linear_cross_entropy(h, w, y.float(), backend=backend)
    with pytest.raises(ConfigurationError, match=r"labels has shape \(2, 2\)"):
        linear_cross_entropy(h, w, y[:, :2], backend=backend)
    with pytest.raises(ConfigurationError, match=r"bias has shape \(3,\)"):
        linear_cross_entropy(h, w, y, bias=torch.randn(3), backend=backend)
    with pytest.raises(InputTypeError, match="floating-point"):
        linear_cross_entropy(h.long(), w.long(), y, backend=backend)
    with pytest.raises(ConfigurationError, match="for a single example use reduction='mean'"):
        linear_cross_entropy(h[0], w, y[0], reduction="per_example", backend=backend)


def test_non_tensor_input_and_bad_backend_type_raise(lce_args):
    h, w, y = lce_args
    with pytest.raises(InputTypeError, match=r"hidden must be a torch\.Tensor, got list"):
        linear_cross_entropy([[0.0]], w, y)
    with pytest.raises(InputTypeError, match="backend must be None or a backend name"):
        linear_cross_entropy(h, w, y, backend=3)


def test_unknown_keyword_arguments_raise(lce_args):
    with pytest.raises(TypeError, match="unexpected keyword argument 'reduce'"):
        linear_cross_entropy(*lce_args, reduce="mean")
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        rms_norm(torch.randn(2, 4), torch.ones(4), epsilon=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_ops_validate_their_arguments(backend):
    x = torch.randn(2, 3, 8)
    with pytest.raises(ConfigurationError, match=r"expected \(8,\)"):
        rms_norm(x, torch.ones(7), backend=backend)
    with pytest.raises(ConfigurationError, match="eps=0"):
        rms_norm(x, torch.ones(8), eps=0, backend=backend)
    with pytest.raises(ConfigurationError, match="must match"):
        swiglu(x, x[..., :4], backend=backend)
    with pytest.raises(InputTypeError, match="use one dtype"):
        swiglu(x, x.double(), backend=backend)
    with pytest.raises(ConfigurationError, match="approximate='fast'"):
        geglu(x, x, approximate="fast", backend=backend)
    with pytest.raises(ConfigurationError, match="even last"):
        rope(torch.randn(2, 3), torch.randn(3), torch.randn(3), backend=backend)
    with pytest.raises(ConfigurationError, match="without enlarging"):
        rope(torch.randn(3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4), backend=backend)
    with pytest.raises(ConfigurationError, match="do not broadcast"):
        rope(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4), backend=backend)
    with pytest.raises(ConfigurationError, match=r"labels has shape \(3,\)"):
        cross_entropy(torch.randn(2, 5), torch.zeros(3, dtype=torch.long), backend=backend)
    with pytest.raises(ConfigurationError, match="non-empty last"):
        cross_entropy(torch.randn(2, 0), torch.zeros(2, dtype=torch.long), backend=backend)
