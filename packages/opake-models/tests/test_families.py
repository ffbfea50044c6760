"""Every first-party family passes the conformance suite (the checks are in opake.models.testing).

Per family: outputs and per-example losses equal the stock model's; per-example gradients and
clipped sums under ``vmap`` (2-D padded masks, loss-only, chunked kernels) equal a per-example
loop of plain autograd on an unpatched copy (fp32, rtol 1e-4); checkpointing recomputes and
keeps the gradients; a PEFT LoRA model works with ``make_functional(partition_trainable=True)``;
dropout runs under ``randomness="different"``; patches are instance-only and reversible.
"""

from __future__ import annotations

import pytest

from opake.models import family_names
from opake.models.testing import CHECKS, ConformanceCase, run_check, tiny_model

CASES = {name: ConformanceCase(lambda name=name: tiny_model(name)) for name in family_names()}
#: DeepSeek-V4's sparse-attention indexer scatters in place: no vmap batching rule, so PyTorch
#: runs that op per example (correct, slower) and says so; and it picks keys with a top-k, so
#: its own parameters get no gradient from the language-model loss (the engine warns that they
#: would train on noise alone: under DP, freeze them)
DEEPSEEK = [
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching rule"
    ),
    pytest.mark.filterwarnings("ignore:clipped_grad. the loss does not depend on differentiated"),
]
FAMILIES = [
    pytest.param(name, marks=DEEPSEEK) if name == "deepseek_v4" else name for name in family_names()
]


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_conformance(family, check):
    run_check(check, CASES[family])


def _triton_on_cpu() -> bool:
    from opake.core import plugins

    backend = plugins.kernel_backends().get("triton")
    return backend is not None and "cpu" in backend.devices and backend.is_available()


@pytest.mark.slow
@pytest.mark.parametrize("check", ["loss_only", "per_example_grads", "clipped_grads"])
def test_triton_kernels_in_the_interpreter(check):
    """Gemma 2 (softcapped loss kernel, tanh GeGLU, RMSNorm with offset) on the Triton backend,
    interpreted on the CPU: the same answers as the loop."""
    pytest.importorskip("triton")
    if not _triton_on_cpu():
        pytest.skip("the triton backend runs on CPU only under TRITON_INTERPRET=1")
    case = ConformanceCase(lambda: tiny_model("gemma2"), kernels="triton", seq=6)
    run_check(check, case)
