"""``torch.compile`` of ``torch.func`` transforms with the runtime patches installed.

Dynamo recognises ``disable_saved_tensors_hooks`` (entered by every ``torch.func`` transform)
by identity in a table built when ``torch._dynamo`` is imported; the ``save_on_cpu`` patch
replaces it. Whether Dynamo was imported before or after the patch, and after the patch is
removed again, a compiled transform traces as one graph. The import order is process-wide
state, so each order runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    if sys.argv[1] == "dynamo-first":
        import torch._dynamo  # noqa: F401
    from torch.func import grad, vmap

    from opake.patches import apply_runtime_patches, remove_runtime_patches

    w = torch.randn(4, 3)

    def loss(p, x):
        return (x @ p).tanh().sum()

    def compiled_equals_eager(tag):
        torch._dynamo.reset()
        step = torch.compile(vmap(grad(loss), in_dims=(None, 0)), backend="eager", fullgraph=True)
        x = torch.randn(5, 4)
        with torch.no_grad():
            got = step(w, x)
        want = vmap(grad(loss), in_dims=(None, 0))(w, x)
        torch.testing.assert_close(got, want)
        print(tag, "ok")

    apply_runtime_patches()
    import torch._dynamo  # noqa: F811 - after the patch in the "patch-first" order
    compiled_equals_eager("patched")
    remove_runtime_patches()
    compiled_equals_eager("stock")
    apply_runtime_patches()
    compiled_equals_eager("patched again")
    # eager save_on_cpu still pushes its hooks (no state left behind by tracing)
    with torch.autograd.graph.save_on_cpu():
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    remove_runtime_patches()
    """
)


@pytest.mark.parametrize("order", ["dynamo-first", "patch-first"])
def test_compiled_transform_traces_in_one_graph_with_and_without_the_patches(order):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, order],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split("\n")[:3] == ["patched ok", "stock ok", "patched again ok"]
