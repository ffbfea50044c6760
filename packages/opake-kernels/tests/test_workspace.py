"""Workspace bounds and tiling plans of the chunked backend."""

from __future__ import annotations

import sys

import pytest
import torch

import opake.kernels.chunked._workspace as ws
from opake.core.errors import ConfigurationError, InputTypeError
from opake.kernels.chunked import (
    WORKSPACE_CAP,
    available_memory,
    resolve_chunking,
    workspace_budget,
)

MIB = 1 << 20


def _bytes(tt, vt, hidden, itemsize):
    if itemsize >= 4:
        return tt * vt * 8
    return tt * vt * (8 + itemsize) + (tt + vt) * itemsize * hidden


@pytest.mark.parametrize("value", [False, 0])
def test_disabled(value):
    assert resolve_chunking(value, "cpu", 512, 32000, torch.float32) is None


@pytest.mark.parametrize("budget", [2 * MIB, 4 * MIB])
def test_small_workspace_gives_square_tiles(budget):
    tt, vt = resolve_chunking(True, "cpu", 512, 32000, torch.float32, workspace_bytes=budget)
    assert 1 <= vt < 32000
    assert tt >= 16
    assert _bytes(tt, vt, 512, 4) <= budget
    assert max(tt, vt) / min(tt, vt) < 4  # as square as the bound allows


@pytest.mark.parametrize(
    ("budget", "dtype"), [(16 * MIB, torch.float32), (256 * MIB, torch.bfloat16)]
)
def test_roomy_workspace_spans_the_vocabulary(budget, dtype):
    tt, vt = resolve_chunking(True, "cpu", 512, 32000, dtype, workspace_bytes=budget)
    assert vt == 32000
    assert tt >= 64
    assert _bytes(tt, vt, 512, dtype.itemsize) <= budget


def test_int_caps_the_vocabulary_tile():
    tt, vt = resolve_chunking(300, "cpu", 64, 32000, torch.bfloat16, workspace_bytes=64 * MIB)
    assert vt == 300
    assert _bytes(tt, vt, 64, 2) <= 64 * MIB


def test_few_tokens_widen_the_vocabulary_tile():
    tt, vt = resolve_chunking(True, "cpu", 64, 32000, torch.float32, tokens=8, workspace_bytes=MIB)
    assert tt == 8
    _tt, vt_many = resolve_chunking(True, "cpu", 64, 32000, torch.float32, workspace_bytes=MIB)
    assert vt > vt_many
    assert _bytes(tt, vt, 64, 4) <= MIB
    # when the whole vocabulary fits for every token, one tile spans it
    assert resolve_chunking(
        True, "cpu", 64, 32000, torch.float32, tokens=8, workspace_bytes=4 * MIB
    ) == (8, 32000)


def test_small_vocabulary_is_one_tile():
    assert resolve_chunking(True, "cpu", 16, 50, torch.float32, tokens=10) == (10, 50)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-4, "cpu", 8, 10, torch.float32), ConfigurationError),
        (("auto", "cpu", 8, 10, torch.float32), InputTypeError),
        ((True, "cpu", 0, 10, torch.float32), ConfigurationError),
        ((True, "cpu", 8, 2.0, torch.float32), ConfigurationError),
        ((True, "tpu", 8, 10, torch.float32), ConfigurationError),
    ],
)
def test_bad_values_raise(args, error):
    with pytest.raises(error):
        resolve_chunking(*args)


def test_budget_respects_cap_and_available_memory(monkeypatch):
    monkeypatch.delenv("OPAKE_CHUNK_WORKSPACE_MB", raising=False)
    assert workspace_budget("cpu") <= WORKSPACE_CAP["cpu"]

    monkeypatch.setattr(ws, "available_memory", lambda device: 24 * MIB)
    assert workspace_budget("cpu") == 3 * MIB  # an eighth of what is free
    monkeypatch.setattr(ws, "available_memory", lambda device: 0)
    assert workspace_budget("cpu") == MIB  # never below the floor


def test_environment_override(monkeypatch):
    monkeypatch.setenv("OPAKE_CHUNK_WORKSPACE_MB", "2.5")
    assert workspace_budget("cuda") == int(2.5 * MIB)
    monkeypatch.setenv("OPAKE_CHUNK_WORKSPACE_MB", "lots")
    with pytest.raises(ConfigurationError, match="OPAKE_CHUNK_WORKSPACE_MB='lots'"):
        workspace_budget("cpu")


def test_available_memory_without_psutil_reads_meminfo(monkeypatch):
    monkeypatch.setattr(ws, "_HOST_TTL_S", 0.0)  # a fresh reading each time
    with_psutil = available_memory("cpu")
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    without = available_memory("cpu")
    assert without > 0
    assert abs(without - with_psutil) < max(with_psutil, without) * 0.5


def test_host_memory_readings_are_reused_for_a_short_time(monkeypatch):
    readings = iter([800 * MIB, 8 * MIB])
    monkeypatch.setattr(ws, "_meminfo_available", lambda: next(readings))
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(ws, "_host_reading", None)
    clock = [100.0]
    monkeypatch.setattr(ws, "_clock", lambda: clock[0])
    assert available_memory("cpu") == 800 * MIB
    clock[0] += ws._HOST_TTL_S / 2  # within the window: the same reading, no new one
    assert available_memory("cpu") == 800 * MIB
    clock[0] += ws._HOST_TTL_S  # past it: read again, and the budget follows
    assert available_memory("cpu") == 8 * MIB
    assert workspace_budget("cpu") == MIB


def test_cuda_budget_without_cuda_assumes_a_default():
    if torch.cuda.is_available():
        assert available_memory("cuda") > 0
    else:
        assert available_memory("cuda") == 1024 * MIB
