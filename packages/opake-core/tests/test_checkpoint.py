"""Tests for opake.dpsgd.checkpoint: atomic writes, crash safety, validation, RNG and state."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from opake.core.errors import InputTypeError, OperationError
from opake.dpsgd.checkpoint import (
    Checkpoint,
    CheckpointError,
    atomic_write,
    load_checkpoint,
    save_checkpoint,
)


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )


class Counter:
    """A minimal stateful component (what accountants and samplers look like to the file)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if set(state) != {"value"}:
            raise ValueError(f"bad counter state {state}")
        self.value = state["value"]


# -- atomic write and crash safety --------------------------------------------------------------


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, lambda f: f.write(b"one"))
    atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_failing_writer_keeps_old_file_and_removes_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def boom(handle) -> None:  # type: ignore[no-untyped-def]
        handle.write(b"partial new content")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, boom)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_new_files_are_owner_only_and_existing_modes_are_kept(tmp_path: Path) -> None:
    fresh = atomic_write(tmp_path / "new.bin", lambda f: f.write(b"x"))
    assert fresh.stat().st_mode & 0o777 == 0o600
    shared = tmp_path / "shared.bin"
    shared.write_bytes(b"old")
    shared.chmod(0o644)
    atomic_write(shared, lambda f: f.write(b"new"))
    assert shared.stat().st_mode & 0o777 == 0o644


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        save_checkpoint(tmp_path / "nope" / "c.pt", step=0, model=make_net())


_SLOW_WRITER = textwrap.dedent(
    """
    import io, sys, time
    import torch
    from opake.dpsgd.checkpoint import _checkpoint

    def slow_write(payload, handle):
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        half = len(data) // 2
        handle.write(data[:half])
        handle.flush()
        print("HALF-WRITTEN", len(data), flush=True)
        time.sleep(120)  # killed here
        handle.write(data[half:])

    _checkpoint._write_payload = slow_write
    torch.manual_seed(1)
    big = {"w": torch.randn(256, 1024)}  # 1 MiB of new content
    _checkpoint.save_checkpoint(sys.argv[1], step=2, model=big)
    print("FINISHED", flush=True)
    """
)


@pytest.mark.slow
def test_process_killed_mid_write_leaves_old_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    torch.manual_seed(0)
    old_weights = {"w": torch.randn(256, 1024)}
    save_checkpoint(path, step=1, model=old_weights, extra={"tag": "old"})
    old_bytes = path.read_bytes()

    with subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line.startswith("HALF-WRITTEN"), line
            temporaries = [p for p in tmp_path.iterdir() if p.name != "run.pt"]
            assert len(temporaries) == 1
            assert temporaries[0].name.startswith(".run.pt.")
            assert temporaries[0].stat().st_size > 0
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    assert path.read_bytes() == old_bytes
    restored = {"w": torch.zeros(256, 1024)}
    ckpt = load_checkpoint(path, model=restored)
    assert ckpt.step == 1
    assert ckpt.extra == {"tag": "old"}
    assert torch.equal(restored["w"], old_weights["w"])
    # the half-written temporary really is incomplete: reading it fails cleanly
    (stale,) = (p for p in tmp_path.iterdir() if p.name != "run.pt")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(stale, model=restored)


# -- round trip ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataclassState:
    clipping_norm: float
    count: torch.Tensor


class TupleState(NamedTuple):
    clipping_norm: float
    history: list[float]


class StatefulClip:
    def __init__(self, norm: float) -> None:
        self.norm = norm

    def state_dict(self) -> dict[str, float]:
        return {"norm": self.norm}

    def load_state_dict(self, state: dict[str, float]) -> StatefulClip:
        return StatefulClip(state["norm"])


def test_round_trip_restores_every_component(tmp_path: Path) -> None:
    net = make_net()
    net(torch.randn(5, 4))  # BatchNorm running stats change: buffers must be saved too
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    acct, sampler = Counter(3), Counter(11)
    clip = DataclassState(0.7, torch.tensor([2, 5]))
    path = save_checkpoint(
        tmp_path / "c.pt",
        step=42,
        model=net,
        optimizer=opt,
        accountant=acct,
        sampler=sampler,
        clip_state=clip,
        extra={"epoch": 3, "lr": [1e-2, 5e-3], "note": None},
    )
    net2 = make_net(seed=5)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    acct2, sampler2 = Counter(), Counter()
    ckpt = load_checkpoint(
        path,
        model=net2,
        optimizer=opt2,
        accountant=acct2,
        sampler=sampler2,
        clip_state=DataclassState(1.0, torch.tensor([0, 0])),
    )
    assert isinstance(ckpt, Checkpoint)
    assert ckpt.step == 42
    assert ckpt.extra == {"epoch": 3, "lr": [1e-2, 5e-3], "note": None}
    assert set(ckpt.components) == {
        "model", "optimizer", "accountant", "sampler", "clip_state", "rng",
    }  # fmt: skip
    for key, value in net.state_dict().items():
        assert torch.equal(value, net2.state_dict()[key]), key
    assert acct2.value == 3
    assert sampler2.value == 11
    assert ckpt.clip_state.clipping_norm == 0.7
    assert torch.equal(ckpt.clip_state.count, torch.tensor([2, 5]))
    state1, state2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for idx in state1:
        for key in state1[idx]:
            assert torch.equal(torch.as_tensor(state1[idx][key]), torch.as_tensor(state2[idx][key]))


@pytest.mark.parametrize(
    ("saved", "template"),
    [
        (TupleState(0.5, [1.0, 0.5]), TupleState(1.0, [])),
        (StatefulClip(0.25), StatefulClip(1.0)),
        (0.125, 1.0),
    ],
    ids=["namedtuple", "state_dict", "plain"],
)
def test_clip_state_kinds_round_trip(tmp_path: Path, saved: object, template: object) -> None:
    path = save_checkpoint(tmp_path / "c.pt", step=0, clip_state=saved, rng=False)
    restored = load_checkpoint(path, clip_state=template).clip_state
    if isinstance(saved, StatefulClip):
        assert restored.norm == saved.norm  # type: ignore[union-attr]
    elif isinstance(saved, tuple):
        assert tuple(restored) == (0.5, [1.0, 0.5])  # type: ignore[arg-type]
    else:
        assert restored == saved


def test_global_rng_states_are_restored(tmp_path: Path) -> None:
    import random

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    path = save_checkpoint(tmp_path / "c.pt", step=0)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    load_checkpoint(path)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0])
    assert got[1:] == expected[1:]


def test_rng_false_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path / "c.pt", step=0)
    torch.manual_seed(4)
    expected = torch.get_rng_state()
    load_checkpoint(path, rng=False)
    assert torch.equal(torch.get_rng_state(), expected)


def test_tensor_dict_model_round_trip(tmp_path: Path) -> None:
    params = {"a": torch.randn(3), "b.c": torch.randn(2, 2)}
    path = save_checkpoint(tmp_path / "c.pt", step=1, model=params)
    target = {"a": torch.zeros(3), "b.c": torch.zeros(2, 2)}
    load_checkpoint(path, model=target)
    assert all(torch.equal(params[k], target[k]) for k in params)


# -- validation ---------------------------------------------------------------------------------


def test_unreadable_and_foreign_files_raise_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(garbage)
    good = save_checkpoint(tmp_path / "good.pt", step=1, model=make_net())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(truncated, model=make_net())
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": make_net().state_dict()}, foreign)
    with pytest.raises(CheckpointError, match="not an Opake checkpoint"):
        load_checkpoint(foreign)
    newer = tmp_path / "newer.pt"
    torch.save({"format": "opake.checkpoint", "version": 99}, newer)
    with pytest.raises(CheckpointError, match="version 99"):
        load_checkpoint(newer)
    # a pickle that would run code is refused by weights_only loading
    evil = tmp_path / "evil.pt"
    with evil.open("wb") as handle:
        pickle.dump(Counter(1), handle)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(evil)
    assert issubclass(CheckpointError, OperationError)


def test_model_mismatch_is_detected_before_anything_changes(tmp_path: Path) -> None:
    net = make_net()
    path = save_checkpoint(tmp_path / "c.pt", step=1, model=net, accountant=Counter(5))
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    acct = Counter(0)
    with pytest.raises(CheckpointError, match=r"missing \[\] , unexpected|unexpected \['2"):
        load_checkpoint(path, model=other, accountant=acct)
    assert acct.value == 0  # validation failed before the accountant was restored
    wider = torch.nn.Sequential(
        torch.nn.Linear(4, 9), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    with pytest.raises(CheckpointError, match=r"0\.weight"):
        load_checkpoint(path, model=wider, accountant=acct)
    assert acct.value == 0


def test_strict_refuses_to_drop_saved_components(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", step=1, model=make_net(), accountant=Counter(5))
    with pytest.raises(CheckpointError, match="under-report"):
        load_checkpoint(path, model=make_net())
    ckpt = load_checkpoint(path, model=make_net(), strict=False)
    assert ckpt.step == 1
    with pytest.raises(CheckpointError, match="holds no sampler"):
        load_checkpoint(path, model=make_net(), accountant=Counter(), sampler=Counter())


def test_component_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", step=1, accountant=Counter(5))

    class OtherAccountant(Counter):
        pass

    with pytest.raises(CheckpointError, match="saved from a Counter"):
        load_checkpoint(path, accountant=OtherAccountant())


def test_component_that_rejects_its_state_gives_checkpoint_error(tmp_path: Path) -> None:
    class Picky(Counter):
        def state_dict(self) -> dict[str, int]:
            return {"other": 1}

    path = save_checkpoint(tmp_path / "c.pt", step=1, sampler=Picky())
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(path, sampler=Picky())


def test_save_refuses_what_cannot_be_loaded_safely(tmp_path: Path) -> None:
    target = tmp_path / "c.pt"
    with pytest.raises(InputTypeError, match=r"extra\['arr'\] is a ndarray"):
        save_checkpoint(target, step=1, extra={"arr": np.zeros(3)})
    with pytest.raises(InputTypeError, match="state_dict"):
        save_checkpoint(target, step=1, sampler=object())
    with pytest.raises(InputTypeError, match="step"):
        save_checkpoint(target, step=-1)
    with pytest.raises(InputTypeError, match=r"nn\.Module"):
        save_checkpoint(target, step=1, model=[torch.zeros(1)])
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError):
        save_checkpoint(target, step=1, modle=make_net())  # type: ignore[call-arg]


def test_a_refused_optimizer_state_restores_nothing_else(tmp_path: Path) -> None:
    """A secure DP optimizer refuses to rewind its noise; the model given with it stays as it
    was (the optimizer's state is checked before any component is restored)."""
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional

    net = torch.nn.Linear(3, 1)
    fmodel, params = make_functional(net)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fmodel(p, x[None]).square().sum()

    grad_fn, state = clipped_grad(loss, clipping_norm=1.0)
    opt = DPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), params, noise_multiplier=1.0,
        expected_batch_size=4.0,
    )  # fmt: skip
    acct = Counter(0)

    def step() -> None:
        grads, _ = grad_fn(params, torch.randn(4, 3), state=state)
        opt.accumulate(grads)
        opt.step()

    step()
    path = save_checkpoint(tmp_path / "c.pt", step=1, model=net, optimizer=opt, accountant=acct)
    step()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    acct.value = 7
    with pytest.raises(CheckpointError, match="again"):
        load_checkpoint(path, model=net, optimizer=opt, accountant=acct)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    assert acct.value == 7
