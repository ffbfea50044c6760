"""Row ranges of one noise draw (``GaussianNoise.draw_rows``, ``Randomness.normal_range_pieces``)
equal the rows of the full draw bit for bit, and a sharded optimizer's ranks add exactly their
own rows (2 gloo processes; a wrong row offset fails here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.randomness import Randomness

SHAPES = {"a.weight": (7, 3), "a.bias": (7,), "b": (1, 5), "c": (4, 2, 3), "d": (0, 2), "e": ()}


def _source(kind: str) -> Randomness:
    """A fresh source per test (a secure one gives each of its draws once)."""
    return Randomness.secure() if kind == "secure" else Randomness.seeded(5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _splits(length: int, world: int) -> list[tuple[int, int]]:
    """FSDP2 / DTensor ``Shard(0)``: torch.chunk's rows, empty shards on the last ranks."""
    size = -(-length // world) if length else 0
    return [(min(r * size, length), min((r + 1) * size, length)) for r in range(world)]


@pytest.mark.parametrize("kind", ["secure", "seeded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_equal_the_rows_of_the_full_draw(kind: str, dtype: torch.dtype) -> None:
    source = _source(kind)
    zeros = {n: torch.zeros(s, dtype=dtype) for n, s in SHAPES.items()}
    full = GaussianNoise(1.3, randomness=source).add(zeros, sensitivity=0.7)
    # a second reader of the key, as another rank holds it (one secure source gives each draw
    # once: test_privacy_noise_reuse.py)
    twin = Randomness.from_key(source.export_key()) if source.is_secure else source
    noise = GaussianNoise(1.3, randomness=twin)
    draw = noise.draw_rows(SHAPES, 0.7)
    assert noise.calls == 1
    assert noise.last_noise_std == pytest.approx(1.3 * 0.7)
    for name, shape in SHAPES.items():
        length = shape[0] if shape else 1
        ranges = {(0, length), (0, 0), (length, length)}
        for world in (1, 2, 3, 4, 8):
            ranges.update(_splits(length, world))
        ranges.update((r, r + 1) for r in range(length))  # 1-row shards
        for start, stop in sorted(ranges):
            rows = draw.rows(name, start, stop, dtype=dtype)
            want = full[name][start:stop] if shape else full[name]
            if not shape and start == stop:
                continue
            assert rows.shape == want.shape
            assert rows.dtype == want.dtype
            assert torch.equal(_bits(rows), _bits(want)), (name, start, stop)


def test_shards_of_every_split_reassemble_the_full_draw_and_are_disjoint() -> None:
    shapes = {"w": (13, 4), "v": (5,)}
    full = GaussianNoise(2.0, seed=3).add({n: torch.zeros(s) for n, s in shapes.items()}, 1.0)
    for world in (2, 3, 5, 16):
        draw = GaussianNoise(2.0, seed=3).draw_rows(shapes, 1.0)
        for name, shape in shapes.items():
            parts = [draw.rows(name, a, b) for a, b in _splits(shape[0], world)]
            assert torch.equal(_bits(torch.cat(parts)), _bits(full[name]))


def test_an_offset_by_one_row_is_different_noise() -> None:
    shapes = {"w": (6, 3)}
    full = GaussianNoise(1.0, seed=1).add({"w": torch.zeros(6, 3)}, 1.0)["w"]
    draw = GaussianNoise(1.0, seed=1).draw_rows(shapes, 1.0)
    assert not torch.equal(draw.rows("w", 1, 4), full[2:5])
    assert not torch.equal(draw.rows("w", 3, 6), full[2:5])
    assert torch.equal(draw.rows("w", 2, 5), full[2:5])


def test_the_next_call_and_other_sources_draw_other_noise() -> None:
    noise = GaussianNoise(1.0, seed=1)
    first = noise.draw_rows({"w": (4,)}, 1.0).rows("w", 0, 4)
    second = noise.draw_rows({"w": (4,)}, 1.0).rows("w", 0, 4)
    other = GaussianNoise(1.0, seed=2).draw_rows({"w": (4,)}, 1.0).rows("w", 0, 4)
    assert not torch.equal(first, second)
    assert not torch.equal(first, other)
    assert noise.calls == 2


def test_normal_range_pieces_cover_any_range_of_the_draw() -> None:
    source = Randomness.seeded(9)
    for count in (1, 2, 3, 11, 2**18 + 3):
        full = source.normal("noise", 4, count, dtype=torch.float64, scale=0.3)
        for start, end in ((0, count), (count // 2, count), (1, count // 2 + 1), (0, 0)):
            stop = min(end, count)
            out = torch.full((stop - start,), float("nan"), dtype=torch.float64)
            for at, values in source.normal_range_pieces(
                "noise", 4, count, start, stop, dtype=torch.float64, scale=0.3
            ):
                out[at - start : at - start + values.numel()] = values
            assert torch.equal(_bits(out), _bits(full[start:stop])), (count, start, stop)


def test_bad_ranges_are_refused() -> None:
    draw = GaussianNoise(1.0, seed=0).draw_rows({"w": (3, 2)}, 1.0)
    with pytest.raises(ConfigurationError):
        draw.rows("w", 2, 4)
    with pytest.raises(ConfigurationError):
        draw.rows("x", 0, 1)
    with pytest.raises(ConfigurationError):
        list(Randomness.seeded(0).normal_range_pieces("noise", 0, 4, 3, 2))


WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from opake.dpsgd.distributed._fsdp import _ShardedNoise
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.noise._rows import NoiseRows

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
fully_shard(model, mesh=mesh)
grads = {n: p.detach() * 0 for n, p in model.named_parameters()}  # FSDP2 shards, uneven
grads["extra"] = distribute_tensor(torch.zeros(7, 2), mesh, [Shard(0)])
grads["plain"] = torch.zeros(3)
asked = []
add_rows = NoiseRows.add_rows_  # each rank noises its rows of the sum in place
def spy(self, name, start, dest):
    asked.append([name, start, start + (dest.shape[0] if dest.ndim else 1)])
    return add_rows(self, name, start, dest)
NoiseRows.add_rows_ = spy
out = _ShardedNoise(GaussianNoise(1.5, seed=4), broadcast=False, group=mesh.get_group(),
                    device=torch.device("cpu")).add(grads, sensitivity=0.5)
want = GaussianNoise(1.5, seed=4).add({n: torch.zeros(g.shape) for n, g in grads.items()}, 0.5)
report = {"asked": [], "equal": {}}
for name, value in out.items():
    local = value.to_local() if hasattr(value, "to_local") else value
    chunks = want[name].chunk(2) if hasattr(value, "to_local") else (want[name],) * 2
    part = chunks[rank] if rank < len(chunks) else want[name][:0]
    report["equal"][name] = tuple(local.shape) == tuple(part.shape) and torch.equal(
        local.view(torch.int32), part.contiguous().view(torch.int32))
    if hasattr(value, "full_tensor"):
        report["equal"][name + ".full"] = torch.equal(value.full_tensor().view(torch.int32),
                                                      want[name].view(torch.int32))
report["asked"] = list(asked)


class Overridden(GaussianNoise):  # its own add(): the full draw, all parameters at once
    def add(self, grads, sensitivity=None):
        return super().add(grads, sensitivity)


for label, inner, broadcast in [("broadcast", GaussianNoise(1.5, seed=4), True),
                                ("overridden", Overridden(1.5, seed=4), False)]:
    other = _ShardedNoise(inner, broadcast=broadcast, group=mesh.get_group(),
                          device=torch.device("cpu")).add(grads, sensitivity=0.5)
    for name, value in other.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        report["equal"][f"{name}.{label}"] = torch.equal(value.view(torch.int32),
                                                         want[name].view(torch.int32))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="this PyTorch build has no gloo backend",
)
def test_each_rank_adds_exactly_its_rows_of_the_full_draw(
    tmp_path: Path, ranks_launcher: Any
) -> None:
    R = ranks_launcher
    R.require_success(R.launch([sys.executable, "-c", WORKER, str(tmp_path)], timeout=120))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in ranks:
        assert report["equal"]
        assert all(report["equal"].values()), report["equal"]
        assert {"0.weight.broadcast", "plain.overridden", "extra.full"} <= set(report["equal"])
        assert len(report["equal"]) == 6 * 4 - 1  # rows, reassembled, broadcast, full draw
    # only this rank's rows were drawn (torch.chunk's split: 5 rows → 3 + 2, 1 row → 1 + 0)
    asked = [{name: (a, b) for name, a, b in r["asked"]} for r in ranks]
    assert asked[0] == {"0.weight": (0, 3), "0.bias": (0, 3), "1.weight": (0, 1),
                        "1.bias": (0, 1), "extra": (0, 4), "plain": (0, 3)}  # fmt: skip
    assert asked[1] == {"0.weight": (3, 5), "0.bias": (3, 5), "1.weight": (0, 0),
                        "1.bias": (0, 0), "extra": (4, 7), "plain": (0, 3)}  # fmt: skip
