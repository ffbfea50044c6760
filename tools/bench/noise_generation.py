"""Secure noise generation as a fraction of one DP-SGD step (the DP-step benchmark model).

The model and batch are those of ``tools/bench/dpsgd_step.py`` (Llama from a config, hidden 256,
4 layers, vocabulary 4096, 5,261,568 trainable parameters; batch 32 × 64 tokens). In one
process, with one torch thread, interleaved over ``--rounds`` rounds, it times (process CPU time
and wall time, medians):

- ``secure noise``: ``GaussianNoise(σ).add(...)`` over every trainable tensor — the ChaCha20
  keystream under an OS key, Box–Muller in fp64 on the CPU, added to the fp32 sums in fp64 and
  rounded once onto the noise's lattice (``opake.dpsgd.noise.noise_grid``);
- ``torch.randn noise``: the same with ``add_noise(..., generator=torch.Generator())`` (torch's
  Mersenne Twister: the previous implementation, not cryptographic), for comparison;
- ``DP step``: one whole step of ``dpsgd_step.py``'s ``opake`` method (``--engine``: vmap or
  bookkeeping; clip, sum, noise, SGD update).

    python tools/bench/noise_generation.py --rounds 5
    python tools/bench/noise_generation.py --threads 2 --baseline OLD_TREE --draws 40

``--threads`` sets torch's thread count (default 1). ``--baseline DIR`` (a source tree of Opake,
e.g. ``git worktree add /tmp/before <commit>``) also times, with the noise and randomness
modules of DIR and of this tree loaded side by side in this process, in a random order per
round over ``--draws`` rounds: the noise path ``DPOptimizer`` takes (``GaussianNoise.add_`` of
the model's 5.26 M values into fp32 sums) and the draw alone (``Randomness.normal_pieces``,
nothing added, each tree's default dtype). It says whether the two trees draw the same values
(a change of the conversion makes them differ) and reports medians, quartiles and ratios.

Results are recorded in docs/benchmarks.md ("Secure noise generation").
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _dpsgd_step() -> Any:
    return _load(Path(__file__).with_name("dpsgd_step.py"), "dpsgd_step")


def _timed(fn: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("vmap", "bookkeeping"), default="bookkeeping")
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", type=Path, default=None, help="an older source tree")
    parser.add_argument("--draws", type=int, default=40, help="rounds of the --baseline A/B")
    args = parser.parse_args()

    import torch

    from opake.dpsgd.noise import GaussianNoise, add_noise

    torch.set_num_threads(args.threads)
    bench = _dpsgd_step()
    model, ids = bench._build("full")
    step, _ = bench._opake(model, ids, args, engine=args.engine)
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    count = sum(t.numel() for t in sums.values())
    secure = GaussianNoise(1.0)
    generator = torch.Generator().manual_seed(0)
    work = {
        "secure noise": lambda: secure.add(sums, sensitivity=1.0),
        "torch.randn noise": lambda: add_noise(
            sums, noise_multiplier=1.0, sensitivity=1.0, generator=generator
        ),
        "DP step": step,
    }
    for fn in work.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in work}
    for _ in range(args.rounds):
        for name, fn in work.items():
            times[name].append(_timed(fn))
    med = {name: (statistics.median(c for c, _ in t), statistics.median(w for _, w in t))
           for name, t in times.items()}  # fmt: skip
    step_cpu, _step_wall = med["DP step"]
    threads = f"{args.threads} torch thread{'s' if args.threads > 1 else ''}"
    print(f"{count:,} noised values; engine {args.engine}; {args.rounds} rounds; {threads}")
    print("| what | CPU s | wall s | fraction of the DP step (CPU) |")
    print("|---|---:|---:|---:|")
    for name, (cpu, wall) in med.items():
        print(f"| {name} | {cpu:.4f} | {wall:.4f} | {cpu / step_cpu:.3f} |")
    if args.baseline is not None:
        _draw_ab(args.baseline, sums, args.draws)


def _tree_modules(tree: Path, tag: str) -> tuple[Any, Any]:
    """The randomness and noise modules of the source tree ``tree`` (the noise module bound to
    that tree's randomness module, whatever this process imported before)."""
    importlib.import_module("opake.dpsgd.noise")  # this tree's modules, bound before the swap
    src = tree / "packages/opake-core/src/opake/dpsgd"
    if (src / "noise").is_dir():  # the concept subpackages (since 0.1.0)
        randomness, noisy, noise_path = "randomness._source", "noise._noisy", "noise/_gaussian.py"
    else:  # an older tree: loose modules
        randomness, noisy, noise_path = "_randomness", "_noisy", "_noise.py"
    bound = {  # randomness first
        f"opake.dpsgd.{name}": src / f"{name.replace('.', '/')}.py" for name in (randomness, noisy)
    }
    loaded = {key: _load(path, f"{path.stem}_{tag}") for key, path in bound.items()}
    saved = {key: sys.modules.get(key) for key in bound}
    sys.modules.update(loaded)  # what the noise module's imports bind
    try:
        noise = _load(src / noise_path, f"_noise_{tag}")
    finally:
        for key, module in saved.items():
            if module is None:
                del sys.modules[key]
            else:
                sys.modules[key] = module
    return next(iter(loaded.values())), noise


def _draw_ab(baseline: Path, sums: dict[str, Any], draws: int) -> None:
    """This tree's noise against ``baseline``'s, interleaved in random order."""
    import random

    import torch

    here = Path(__file__).resolve().parents[2]
    trees = {"this tree": _tree_modules(here, "new"), "baseline": _tree_modules(baseline, "old")}
    count = sum(t.numel() for t in sums.values())
    first, second = (r.Randomness.seeded(1).normal("noise", 0, 100_001) for r, _ in trees.values())
    same = torch.equal(first, second)
    work: dict[str, Any] = {}
    for name, (randomness, noise) in trees.items():
        source = randomness.Randomness.seeded(1)
        gaussian = noise.GaussianNoise(1.0, randomness=randomness.Randomness.secure())

        def add_(gaussian: Any = gaussian) -> None:
            gaussian.add_(sums, sensitivity=1.0)

        def draw(source: Any = source) -> None:
            for _ in source.normal_pieces("noise", 0, count):
                pass

        work[f"GaussianNoise.add_, {name}"] = add_
        work[f"draw alone, {name}"] = draw
    times: dict[str, list[float]] = {label: [] for label in work}
    order = list(work)
    rng = random.Random(0)
    for _ in range(draws + 2):
        rng.shuffle(order)
        for label in order:
            start = time.perf_counter()
            work[label]()
            times[label].append(time.perf_counter() - start)
    print(f"\n{count:,} values, {draws} interleaved rounds, wall ms; the two trees draw "
          f"{'the same' if same else 'different'} values")  # fmt: skip
    print("| what | median | quartiles |")
    print("|---|---:|---:|")
    for label, values in times.items():
        q = statistics.quantiles(values[2:], n=4)
        print(f"| {label} | {q[1] * 1e3:.1f} | {q[0] * 1e3:.1f}–{q[2] * 1e3:.1f} |")
    for what in ("GaussianNoise.add_", "draw alone"):
        new = statistics.median(times[f"{what}, this tree"][2:])
        old = statistics.median(times[f"{what}, baseline"][2:])
        print(f"{what}: this tree / baseline = {new / old:.2f}")


if __name__ == "__main__":
    main()
