"""This tree's secure noise against an older tree's, side by side in one process.

Prints ``tools/bench/noise_generation.py``'s table (same options), then, with the noise and
randomness modules of ``--baseline`` (a source tree of Opake, e.g. ``git worktree add
/tmp/before <commit>``) and of this tree loaded side by side in this process, in a random order
per round over ``--draws`` rounds: the noise path ``DPOptimizer`` takes (``GaussianNoise.add_``
of the model's 5.26 M values into fp32 sums) and the draw alone (``Randomness.normal_pieces``,
nothing added, each tree's default dtype). It says whether the two trees draw the same values
(a change of the conversion makes them differ) and reports medians, quartiles and ratios.

Loading two trees' modules in one process means loading their private modules by file
(``opake.dpsgd.randomness._source``, ``opake.dpsgd.noise._noisy``, ...): a developer tool, not
shipped.

    python tools/profile/noise_ab.py --threads 2 --baseline OLD_TREE --draws 40

Results are recorded in docs/benchmarks.md ("Secure noise generation").
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # noise_generation.py

import noise_generation


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = noise_generation.parser()
    parser.add_argument("--baseline", type=Path, required=True, help="an older source tree")
    parser.add_argument("--draws", type=int, default=40, help="rounds of the A/B")
    args = parser.parse_args()
    sums = noise_generation.measure(args)
    _draw_ab(args.baseline, sums, args.draws)
    return 0


def _tree_modules(tree: Path, tag: str) -> tuple[Any, Any]:
    """The randomness and noise modules of the source tree ``tree`` (the noise module bound to
    that tree's randomness module, whatever this process imported before)."""
    importlib.import_module("opake.dpsgd.noise")  # this tree's modules, bound before the swap
    src = tree / "packages/opake-core/src/opake/dpsgd"
    if (src / "noise").is_dir():  # the concept subpackages (since 0.1.0)
        randomness, noisy, noise_path = "randomness._source", "noise._noisy", "noise/_gaussian.py"
    else:  # an older tree: loose modules
        randomness, noisy, noise_path = "_randomness", "_noisy", "_noise.py"
    # the resolver (since 6 Dec 2026) checks instances against its tree's source module
    names = (randomness, "randomness._resolve", noisy)
    files = {name: src / f"{name.replace('.', '/')}.py" for name in names}
    # randomness first; a tree from before _noisy.py binds its randomness module only
    bound = {f"opake.dpsgd.{name}": path for name, path in files.items() if path.is_file()}
    saved = {key: sys.modules.get(key) for key in bound}
    loaded: dict[str, Any] = {}
    try:
        for key, path in bound.items():  # each binds the ones loaded before it
            loaded[key] = sys.modules[key] = _load(path, f"{path.stem}_{tag}")
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
    sys.exit(main())
