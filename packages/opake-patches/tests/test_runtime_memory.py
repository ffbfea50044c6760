"""The vmap-safe checkpoint really cuts memory (peak RSS of fresh processes, on vs off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, torch
from torch.func import grad, vmap
import torch.utils.checkpoint as tuc
from opake.patches import apply_runtime_patches

apply_runtime_patches()
mode = sys.argv[1]
torch.manual_seed(0)
ws = [torch.randn(1024) * 0.1 for _ in range(12)]

def block(h, w):  # elementwise-heavy: many saved activations, few FLOPs
    for _ in range(8):
        h = torch.tanh(h * w) + h
    return h

def loss(ws, x):
    h = x
    for w in ws:
        h = tuc.checkpoint(block, h, w, use_reentrant=False) if mode == "on" else block(h, w)
    return h.pow(2).mean()

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

x = torch.randn(8, 48, 1024)
# Reset the peak (VmHWM) to the current RSS: measure this step only. (Not getrusage's ru_maxrss:
# a process started by fork + exec keeps its parent's peak there, so under pytest both runs read
# the pytest process's peak, ~1.1 GiB, whatever the step did.)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
with torch.no_grad():
    g = vmap(grad(loss), in_dims=(None, 0))(ws, x)
print(status("VmHWM") - before, float(sum(t.double().sum() for t in g)), before)
"""


def _run(mode: str) -> tuple[float, float]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # RSS tracks live tensors, not allocator slack
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    )
    increase, fingerprint, _before = out.stdout.split()
    return float(increase), float(fingerprint)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_checkpointing_cuts_the_step_peak():
    off, fp_off = _run("off")
    on, fp_on = _run("on")
    assert fp_on == pytest.approx(fp_off, rel=1e-6)  # same gradients
    # 12 blocks of 8 elementwise steps: without checkpointing every block's activations are
    # alive at the end of the forward; with it, one block's (measured ratio ~4.3)
    assert off > 3 * on, (off, on)
