"""Where the book-keeping step's time goes on the mixture-of-experts models of ``moe_step.py``.

Builds the ``bookkeeping`` step of ``tools/bench/moe_step.py`` for each ``--models`` entry (same
options: ``--train``, ``--threads``, ``--rounds``, ``--steps``; ``--methods`` is ignored) and
wraps the engine's main calls (:data:`BREAKDOWN`, private functions of ``opake.dpsgd`` and
``opake.models``) to add up their process time. Per model: the step's CPU time and the time
inside each call, per step, median over rounds (after one warm-up step per round; the calls
nest, so the rows do not add up).

    python tools/profile/moe_breakdown.py --threads 1
    python tools/profile/moe_breakdown.py --models mixtral --train experts --rounds 5
"""

from __future__ import annotations

import functools
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # moe_step.py

import moe_step

#: (module, attribute) timed inside each book-keeping step
BREAKDOWN = (
    ("opake.dpsgd.bookkeeping._runner", "BookkeepingRunner._forward_backward"),
    ("opake.dpsgd.bookkeeping._fused", "LeafBoundsFn.__call__"),
    ("opake.dpsgd.bookkeeping._chunk", "BookkeepingChunk.accumulate"),
    ("opake.models.bookkeeping._record", "experts_forward"),
    ("opake.models.bookkeeping._record", "_Saved.build"),
    ("opake.models.bookkeeping._grads", "ExpertGrads.certificate"),
    ("opake.models.bookkeeping._grads", "ExpertGrads.weighted_sum"),
)
SPENT: dict[str, float] = {}


def instrument() -> None:
    """Wrap every :data:`BREAKDOWN` call to add its process time to :data:`SPENT`."""
    for module_name, path in BREAKDOWN:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, attr)

        def timed(*args: Any, _f: Any = original, _key: str = path, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return _f(*args, **kwargs)
            finally:
                SPENT[_key] = SPENT.get(_key, 0.0) + time.process_time() - start

        setattr(owner, attr, functools.wraps(original)(timed))


def main() -> int:
    args = moe_step.parser().parse_args()
    moe_step.configure(args)
    instrument()
    for name in args.models:
        step = moe_step.build_step(name, "bookkeeping", args)
        total: list[float] = []
        inside: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            step()  # warm-up (and the engine's first-call check)
            SPENT.clear()
            start = time.process_time()
            for _ in range(args.steps):
                step()
            total.append((time.process_time() - start) / args.steps)
            for call, spent in SPENT.items():
                inside.setdefault(call, []).append(spent / args.steps)
        print(f"\n{name}, book-keeping step, CPU ms per step (median over {args.rounds} rounds):")
        print(f"- the whole step: {1000 * statistics.median(total):.1f}")
        for call, values in inside.items():
            print(f"- {call}: {1000 * statistics.median(values):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
